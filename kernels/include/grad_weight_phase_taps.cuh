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

// Offset of product (ic, oc, tap) in one split's partials.  For a contiguous weight they are tap-major,
// [tap][ic][oc], so that a warp's stores fill whole sectors (in the weight's own layout a block's four taps
// leave every 4-byte store its own sector), and the reduce moves the taps last; a channels_last weight's
// own layout, [ic][tap][oc], already keeps a warp's output channels together, so its partials (and a single
// split's grad_weight) are written in it.
__device__ __forceinline__ index_t tap_partial_index(index_t ic, int oc, int tap) {
    return WEIGHT_CL ? weight_index(ic, oc, tap) : (static_cast<index_t>(tap) * CIN + ic) * COUT_G + oc;
}

// Writes a warpgroup's accumulators (wgmma's m64nBN layout, rows = input channels m0 + 64 wg + ... of group g)
// into this split's partials, `out` pointing at the split's first element.
template <int TAP_GROUP, int BN, typename partial_t>
__device__ __forceinline__ void store_tap_partials(const float (&acc)[TAP_GROUP][BN / 2], int taps, const int* tap_ids,
                                                   partial_t* out, int g, int m0, int n0, int wg, int warp, int lane) {
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) {
        if (t >= taps) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int ic = m0 + wg * 64 + warp * 16 + lane / 4 + h * 8;
            if (ic >= CIN_G) continue;
            const index_t row = static_cast<index_t>(g) * CIN_G + ic;
#pragma unroll
            for (int jn = 0; jn < BN / 8; ++jn) {
                const int oc = n0 + jn * 8 + (lane % 4) * 2;
                const float v0 = acc[t][jn * 4 + h * 2], v1 = acc[t][jn * 4 + h * 2 + 1];
                if constexpr (COUT_G % 2 == 0) {
                    // A thread's two neighbouring output channels in one store: a warp's stores then fill half
                    // sectors of 16-bit values (whole ones of fp32) rather than a quarter.
                    if (oc < COUT_G) store_pair(out + tap_partial_index(row, oc, tap_ids[t]), v0, v1);
                } else {
                    if (oc < COUT_G) store(out + tap_partial_index(row, oc, tap_ids[t]), v0);
                    if (oc + 1 < COUT_G) store(out + tap_partial_index(row, oc + 1, tap_ids[t]), v1);
                }
            }
        }
    }
}
