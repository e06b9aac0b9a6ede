// Transposed-convolution forward as a gather, decomposed by stride phase.
//
// Output row oh belongs to phase rh = (oh + PH) % SH and low-resolution row
// q = (oh + PH) / SH.  Tap kh feeds only phase (kh*DH) % SH, reading input row
// q - (kh*DH) / SH, so each thread owns one (q_h, q_w) cell and produces all
// SH*SW outputs of that cell: every tap is used exactly once, none is tested
// and discarded, and the inner loop has no division or modulo.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef {{ACC_T}} acc_t;
typedef {{INDEX_T}} index_t;

constexpr int KH = {{KH}}, KW = {{KW}};
constexpr int SH = {{SH}}, SW = {{SW}};
constexpr int PH = {{PH}}, PW = {{PW}};
constexpr int OPH = {{OPH}}, OPW = {{OPW}};  // already folded into H_out/W_out by the host
constexpr int DH = {{DH}}, DW = {{DW}};
constexpr int GROUPS = {{GROUPS}};
constexpr int CIN_G = {{CIN_G}}, COUT_G = {{COUT_G}};
constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int OC_BLOCK = {{OC_BLOCK}};  // output channels per thread: reuses each input load
constexpr int BLOCK = {{BLOCK}};
constexpr int OC_BLOCKS = (COUT_G + OC_BLOCK - 1) / OC_BLOCK;
constexpr int CIN = CIN_G * GROUPS;
constexpr int COUT = COUT_G * GROUPS;

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_forward(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                         const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                         index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                         index_t q_h0, index_t q_w0, index_t QH, index_t QW) {
    const index_t cell = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x;
    if (cell >= QH * QW) return;
    const index_t qh = q_h0 + cell / QW;
    const index_t qw = q_w0 + cell % QW;

    // Input rows and columns each tap reads, fixed for this thread.
    index_t row_off[KH];
    bool row_ok[KH];
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) {
        const index_t ih = qh - (kh * DH) / SH;
        row_ok[kh] = ih >= 0 && ih < H;
        row_off[kh] = ih * W;
    }
    index_t col[KW];
    bool col_ok[KW];
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) {
        const index_t iw = qw - (kw * DW) / SW;
        col_ok[kw] = iw >= 0 && iw < W;
        col[kw] = iw;
    }

    for (int ocb = blockIdx.y; ocb < GROUPS * OC_BLOCKS; ocb += gridDim.y) {
        const int g = ocb / OC_BLOCKS;
        const int ocg0 = (ocb % OC_BLOCKS) * OC_BLOCK;
        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[SH][SW][OC_BLOCK];
#pragma unroll
            for (int o = 0; o < OC_BLOCK; ++o) {
                const int ocg = ocg0 + o < COUT_G ? ocg0 + o : COUT_G - 1;
                const acc_t b = HAS_BIAS ? static_cast<acc_t>(load(bias + g * COUT_G + ocg)) : acc_t(0);
#pragma unroll
                for (int rh = 0; rh < SH; ++rh)
#pragma unroll
                    for (int rw = 0; rw < SW; ++rw) acc[rh][rw][o] = b;
            }

            const scalar_t* xg = x + (n * CIN + g * CIN_G) * H * W;
            const scalar_t* wg = w + (static_cast<index_t>(g) * CIN_G * COUT_G) * (KH * KW);
#pragma unroll 2
            for (int ic = 0; ic < CIN_G; ++ic) {
                const scalar_t* xc = xg + ic * H * W;
                const scalar_t* wc = wg + static_cast<index_t>(ic) * COUT_G * (KH * KW);
#pragma unroll
                for (int kh = 0; kh < KH; ++kh) {
#pragma unroll
                    for (int kw = 0; kw < KW; ++kw) {
                        const acc_t xv = (row_ok[kh] && col_ok[kw])
                                             ? static_cast<acc_t>(load(xc + row_off[kh] + col[kw]))
                                             : acc_t(0);
#pragma unroll
                        for (int o = 0; o < OC_BLOCK; ++o) {
                            const int ocg = ocg0 + o < COUT_G ? ocg0 + o : COUT_G - 1;
                            const acc_t wv = static_cast<acc_t>(load(wc + (ocg * KH + kh) * KW + kw));
                            acc[(kh * DH) % SH][(kw * DW) % SW][o] += xv * wv;
                        }
                    }
                }
            }

#pragma unroll
            for (int rh = 0; rh < SH; ++rh) {
                const index_t oh = qh * SH + rh - PH;
                if (oh < 0 || oh >= H_out) continue;
#pragma unroll
                for (int rw = 0; rw < SW; ++rw) {
                    const index_t ow = qw * SW + rw - PW;
                    if (ow < 0 || ow >= W_out) continue;
#pragma unroll
                    for (int o = 0; o < OC_BLOCK; ++o) {
                        if (ocg0 + o >= COUT_G) continue;
                        const index_t oc = g * COUT_G + ocg0 + o;
                        store(y + ((n * COUT + oc) * H_out + oh) * W_out + ow, acc[rh][rw][o]);
                    }
                }
            }
        }
    }
}
