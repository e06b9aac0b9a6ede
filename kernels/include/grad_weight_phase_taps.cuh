// The parts of grad_weight's wgmma kernels that do not depend on how operands sit in shared
// memory: which taps of a stride phase a block takes, where each one's grad_out halo starts,
// and the tap-major partial stores of the accumulators.
// Needs layer.cuh.
#pragma once

// floor(a / b) for b > 0
__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Stride phase (rh, rw)'s taps in row-major order; the block takes chunk `chunk` of TAP_GROUP of
// them and gets their ids and the halo pixel each one's window starts at (rows of halo_w pixels).
// The halo starts at the phase's smallest shift (lo_h, lo_w), so every chunk of it fits the
// phase's span.  Returns the chunk's tap count: zero where a phase has fewer taps than chunks of
// the widest phase.
template <int TAP_GROUP>
__device__ __forceinline__ int find_phase_taps(int rh, int rw, int chunk, int halo_w, int* ids, int* origins,
                                               int& lo_h, int& lo_w) {
    int seen = 0, count = 0;
    lo_h = 1 << 30;
    lo_w = 1 << 30;
    for (int kh = 0; kh < KH; ++kh) {
        if (((kh * DH - PH) % SH + SH) % SH != rh) continue;
        for (int kw = 0; kw < KW; ++kw) {
            if (((kw * DW - PW) % SW + SW) % SW != rw) continue;
            lo_h = min(lo_h, floor_div(kh * DH - PH, SH));
            lo_w = min(lo_w, floor_div(kw * DW - PW, SW));
            if (seen / TAP_GROUP == chunk) ids[count++] = kh * KW + kw;
            ++seen;
        }
    }
    for (int t = 0; t < count; ++t) {
        const int kh = ids[t] / KW, kw = ids[t] % KW;
        origins[t] = (floor_div(kh * DH - PH, SH) - lo_h) * halo_w + floor_div(kw * DW - PW, SW) - lo_w;
    }
    return count;
}

// Writes a warpgroup's accumulators (wgmma's m64nBN layout, rows = input channels from m0 + 64 wg)
// into this split's partial[tap][g*CIN_G + ic][oc], `out` pointing at the group's first row.
template <int TAP_GROUP, int BN, typename partial_t>
__device__ __forceinline__ void store_tap_partials(const float (&acc)[TAP_GROUP][BN / 2], int taps, const int* tap_ids,
                                                   partial_t* out, int m0, int n0, int wg, int warp, int lane) {
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) {
        if (t >= taps) continue;
        partial_t* tap_out = out + static_cast<index_t>(tap_ids[t]) * CIN * COUT_G;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int ic = m0 + wg * 64 + warp * 16 + lane / 4 + h * 8;
            if (ic >= CIN_G) continue;
#pragma unroll
            for (int jn = 0; jn < BN / 8; ++jn)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int oc = n0 + jn * 8 + (lane % 4) * 2 + q;
                    if (oc < COUT_G) store(tap_out + static_cast<index_t>(ic) * COUT_G + oc, acc[t][jn * 4 + h * 2 + q]);
                }
        }
    }
}
