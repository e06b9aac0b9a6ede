// The layer a convolution kernel is specialised for: element and index types and the
// transposed convolution's geometry, all compile-time constants so that every tap
// loop unrolls and every division by a stride or a channel count is by a constant.
//
// Weight layout, as in torch: (C_in, C_out / GROUPS, KH, KW), contiguous, or channels_last
// (WEIGHT_CL), whose memory runs (C_in, KH, KW, C_out / GROUPS).  Every weight and grad_weight
// offset goes through weight_index, so a channels_last weight is read and written in place.
#pragma once
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef Accumulator<scalar_t>::type acc_t;
typedef {{INDEX_T}} index_t;

constexpr int KH = {{KH}}, KW = {{KW}};
constexpr int SH = {{SH}}, SW = {{SW}};
constexpr int PH = {{PH}}, PW = {{PW}};
constexpr int DH = {{DH}}, DW = {{DW}};
constexpr int GROUPS = {{GROUPS}};
constexpr int CIN_G = {{CIN_G}}, COUT_G = {{COUT_G}};
constexpr int CIN = CIN_G * GROUPS;
constexpr int COUT = COUT_G * GROUPS;
constexpr int TAPS = KH * KW;
constexpr bool WEIGHT_CL = {{WEIGHT_CL}};

// Offset of weight element [ic][ocg][kh][kw]; ic counts the input channels of every group.
// The tap is numbered kh * KW + kw.
__device__ __forceinline__ index_t weight_index(index_t ic, int ocg, int tap) {
    return WEIGHT_CL ? (ic * TAPS + tap) * COUT_G + ocg : (ic * COUT_G + ocg) * TAPS + tap;
}
__device__ __forceinline__ index_t weight_index(index_t ic, int ocg, int kh, int kw) {
    return weight_index(ic, ocg, kh * KW + kw);
}
