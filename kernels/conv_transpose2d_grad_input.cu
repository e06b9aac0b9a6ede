// grad_input of a transposed convolution, which is the ordinary convolution
// conv2d(grad_output, weight, stride, padding, dilation, groups), as a gather.
//
// Each thread owns one input pixel and IC_BLOCK input channels of one group,
// so every grad_output value it loads is used IC_BLOCK times.
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
constexpr int IC_BLOCK = {{IC_BLOCK}};
constexpr int BLOCK = {{BLOCK}};
constexpr int IC_BLOCKS = (CIN_G + IC_BLOCK - 1) / IC_BLOCK;
constexpr int CIN = CIN_G * GROUPS;
constexpr int COUT = COUT_G * GROUPS;

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_input(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ w,
                            scalar_t* __restrict__ grad_in,
                            index_t N, index_t H, index_t W, index_t H_out, index_t W_out) {
    const index_t pixel = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x;
    if (pixel >= H * W) return;
    const index_t ih = pixel / W;
    const index_t iw = pixel % W;

    index_t row_off[KH];
    bool row_ok[KH];
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) {
        const index_t oh = ih * SH - PH + kh * DH;
        row_ok[kh] = oh >= 0 && oh < H_out;
        row_off[kh] = oh * W_out;
    }
    index_t col[KW];
    bool col_ok[KW];
#pragma unroll
    for (int kw = 0; kw < KW; ++kw) {
        const index_t ow = iw * SW - PW + kw * DW;
        col_ok[kw] = ow >= 0 && ow < W_out;
        col[kw] = ow;
    }

    for (int icb = blockIdx.y; icb < GROUPS * IC_BLOCKS; icb += gridDim.y) {
        const int g = icb / IC_BLOCKS;
        const int icg0 = (icb % IC_BLOCKS) * IC_BLOCK;
        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[IC_BLOCK];
#pragma unroll
            for (int i = 0; i < IC_BLOCK; ++i) acc[i] = acc_t(0);

            const scalar_t* gg = grad_out + (n * COUT + g * COUT_G) * H_out * W_out;
#pragma unroll 2
            for (int ocg = 0; ocg < COUT_G; ++ocg) {
                const scalar_t* gc = gg + ocg * H_out * W_out;
#pragma unroll
                for (int kh = 0; kh < KH; ++kh) {
#pragma unroll
                    for (int kw = 0; kw < KW; ++kw) {
                        const acc_t gv = (row_ok[kh] && col_ok[kw])
                                             ? static_cast<acc_t>(load(gc + row_off[kh] + col[kw]))
                                             : acc_t(0);
#pragma unroll
                        for (int i = 0; i < IC_BLOCK; ++i) {
                            const int icg = icg0 + i < CIN_G ? icg0 + i : CIN_G - 1;
                            const index_t ic = static_cast<index_t>(g) * CIN_G + icg;
                            acc[i] += gv * static_cast<acc_t>(load(w + ((ic * COUT_G + ocg) * KH + kh) * KW + kw));
                        }
                    }
                }
            }

#pragma unroll
            for (int i = 0; i < IC_BLOCK; ++i) {
                if (icg0 + i >= CIN_G) continue;
                const index_t ic = static_cast<index_t>(g) * CIN_G + icg0 + i;
                store(grad_in + ((n * CIN + ic) * H + ih) * W + iw, acc[i]);
            }
        }
    }
}
