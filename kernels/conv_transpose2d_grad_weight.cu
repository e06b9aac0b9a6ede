// grad_weight of a transposed convolution, first pass of a deterministic split-K.
//
// grad_weight[ic, ocg, kh, kw] = sum over n, ih, iw of
//     x[n, ic, ih, iw] * grad_out[n, oc, ih*SH - PH + kh*DH, iw*SW - PW + kw*DW]
// The (n, ih) rows are cut into fixed chunks, one per blockIdx.x; each block
// reduces its chunk in a fixed order and writes one partial per weight element
// (no atomics), and reduce_partials.cu sums the chunks in a fixed order.  So the
// result is bitwise reproducible for a given shape and device.
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
constexpr int OC_BLOCK = {{OC_BLOCK}};    // output channels per thread: reuses each input load
constexpr int TAP_BLOCK = {{TAP_BLOCK}};  // kernel taps per thread; blockIdx.z picks which
constexpr int BLOCK = {{BLOCK}};
constexpr int TAPS = KH * KW;
constexpr int OC_BLOCKS = (COUT_G + OC_BLOCK - 1) / OC_BLOCK;
constexpr int CIN = CIN_G * GROUPS;
constexpr int COUT = COUT_G * GROUPS;
constexpr int WARPS = BLOCK / 32;
constexpr int VALUES = OC_BLOCK * TAP_BLOCK;

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_weight_partial(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                     acc_t* __restrict__ partial,
                                     index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                                     index_t rows_per_chunk) {
    __shared__ acc_t warp_partials[WARPS][VALUES];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const index_t rows = N * H;
    const index_t r0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
    const index_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;

    bool tap_ok[TAP_BLOCK];
    int tap_dh[TAP_BLOCK], tap_dw[TAP_BLOCK];
#pragma unroll
    for (int j = 0; j < TAP_BLOCK; ++j) {
        const int t = blockIdx.z * TAP_BLOCK + j;
        tap_ok[j] = t < TAPS;
        tap_dh[j] = (t / KW) * DH - PH;
        tap_dw[j] = (t % KW) * DW - PW;
    }

    for (int yb = blockIdx.y; yb < CIN * OC_BLOCKS; yb += gridDim.y) {
        const int ic = yb / OC_BLOCKS;
        const int g = ic / CIN_G;
        const int ocg0 = (yb % OC_BLOCKS) * OC_BLOCK;

        acc_t acc[OC_BLOCK][TAP_BLOCK];
#pragma unroll
        for (int o = 0; o < OC_BLOCK; ++o)
#pragma unroll
            for (int j = 0; j < TAP_BLOCK; ++j) acc[o][j] = acc_t(0);

        for (index_t r = r0 + warp; r < r1; r += WARPS) {
            const index_t n = r / H;
            const index_t ih = r % H;
            const scalar_t* xrow = x + ((n * CIN + ic) * H + ih) * W;
            const scalar_t* gbase = grad_out + (n * COUT + g * COUT_G) * H_out * W_out;
            bool row_ok[TAP_BLOCK];
            index_t row_off[TAP_BLOCK];
#pragma unroll
            for (int j = 0; j < TAP_BLOCK; ++j) {
                const index_t oh = ih * SH + tap_dh[j];
                row_ok[j] = tap_ok[j] && oh >= 0 && oh < H_out;
                row_off[j] = oh * W_out;
            }
            for (index_t iw = lane; iw < W; iw += 32) {
                const acc_t xv = static_cast<acc_t>(load(xrow + iw));
#pragma unroll
                for (int j = 0; j < TAP_BLOCK; ++j) {
                    const index_t ow = iw * SW + tap_dw[j];
                    const bool ok = row_ok[j] && ow >= 0 && ow < W_out;
#pragma unroll
                    for (int o = 0; o < OC_BLOCK; ++o) {
                        const int ocg = ocg0 + o < COUT_G ? ocg0 + o : COUT_G - 1;
                        const acc_t gv = ok ? static_cast<acc_t>(load(gbase + ocg * H_out * W_out + row_off[j] + ow))
                                            : acc_t(0);
                        acc[o][j] += xv * gv;
                    }
                }
            }
        }

#pragma unroll
        for (int o = 0; o < OC_BLOCK; ++o)
#pragma unroll
            for (int j = 0; j < TAP_BLOCK; ++j) {
                const acc_t s = warp_sum(acc[o][j]);
                if (lane == 0) warp_partials[warp][o * TAP_BLOCK + j] = s;
            }
        __syncthreads();
        for (int v = threadIdx.x; v < VALUES; v += BLOCK) {
            const int o = v / TAP_BLOCK, j = v % TAP_BLOCK;
            const int t = blockIdx.z * TAP_BLOCK + j;
            if (ocg0 + o < COUT_G && t < TAPS) {
                acc_t s = acc_t(0);
#pragma unroll
                for (int k = 0; k < WARPS; ++k) s += warp_partials[k][v];
                const index_t e = (static_cast<index_t>(ic) * COUT_G + ocg0 + o) * TAPS + t;
                partial[static_cast<index_t>(blockIdx.x) * (static_cast<index_t>(CIN) * COUT_G * TAPS) + e] = s;
            }
        }
        __syncthreads();
    }
}
