// The layer a convolution kernel is specialised for: element and index types and the
// transposed convolution's geometry, all compile-time constants so that every tap
// loop unrolls and every division by a stride or a channel count is by a constant.
//
// Weight layout, as in torch: (C_in, C_out / GROUPS, KH, KW).
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

// Offset of weight element [ic][ocg][kh][kw]; ic counts the input channels of every group.
__device__ __forceinline__ index_t weight_index(index_t ic, int ocg, int kh, int kw) {
    return ((ic * COUT_G + ocg) * KH + kh) * KW + kw;
}
// The same with the tap numbered kh * KW + kw.
__device__ __forceinline__ index_t weight_index(index_t ic, int ocg, int tap) {
    return (ic * COUT_G + ocg) * TAPS + tap;
}
