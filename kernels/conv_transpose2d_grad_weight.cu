// grad_weight of a transposed convolution, first pass of a deterministic split-K.
//
// grad_weight[ic, ocg, kh, kw] = sum over n, ih, iw of
//     x[n, ic, ih, iw] * grad_out[n, oc, ih*SH - PH + kh*DH, iw*SW - PW + kw*DW]
// The (n, ih) rows are cut into fixed chunks, one per blockIdx.x; each block
// reduces its chunk in a fixed order and writes one partial per weight element
// (no atomics), and reduce_partials.cu sums the chunks in a fixed order.  So the
// result is bitwise reproducible for a given shape and device.
//
// A thread takes CELLS adjacent pixels of a row at a time and keeps an
// IC_BLOCK x OC_BLOCK x KH_BLOCK x KW block of the weight gradient in registers:
// each input value it loads serves OC_BLOCK * KH_BLOCK * KW taps, and each
// grad_output row segment (a register window shared by all kw and all CELLS
// pixels) serves IC_BLOCK input channels.
#include "layer.cuh"
#include "grad_weight_cells.cuh"

constexpr int IC_BLOCK = {{IC_BLOCK}};  // input channels per thread
constexpr int OC_BLOCK = {{OC_BLOCK}};  // output channels per thread
constexpr int KH_BLOCK = {{KH_BLOCK}};  // kernel rows per thread; blockIdx.z picks which
constexpr int CELLS = {{CELLS}};        // adjacent input pixels per step
constexpr int BLOCK = {{BLOCK}};
constexpr int IC_BLOCKS = (CIN_G + IC_BLOCK - 1) / IC_BLOCK;
constexpr int OC_BLOCKS = (COUT_G + OC_BLOCK - 1) / OC_BLOCK;
constexpr int WARPS = BLOCK / 32;
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};  // one chunk: write grad_weight itself
typedef PartialOut<SINGLE_CHUNK, scalar_t, acc_t>::type partial_t;
constexpr int VALUES = IC_BLOCK * OC_BLOCK * KH_BLOCK * KW;
constexpr int RW = (CELLS - 1) * SW + (KW - 1) * DW + 1;  // grad_output columns the CELLS pixels read

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_weight_partial(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                     partial_t* __restrict__ partial,
                                     index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                                     index_t cells_w, index_t rows_per_chunk) {
    __shared__ acc_t warp_partials[WARPS][VALUES];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const index_t r0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
    const index_t r1 = r0 + rows_per_chunk < N * H ? r0 + rows_per_chunk : N * H;
    const index_t items = (r1 - r0) * cells_w;
    // A thread's walk over its items advances by BLOCK cells at a time.
    const index_t row_step = BLOCK / cells_w, cell_step = BLOCK % cells_w;
    const int kh0 = blockIdx.z * KH_BLOCK;

    for (int yb = blockIdx.y; yb < GROUPS * IC_BLOCKS * OC_BLOCKS; yb += gridDim.y) {
        const int g = yb / (IC_BLOCKS * OC_BLOCKS);
        const int icg0 = yb / OC_BLOCKS % IC_BLOCKS * IC_BLOCK;
        const int ocg0 = yb % OC_BLOCKS * OC_BLOCK;

        acc_t acc[IC_BLOCK][OC_BLOCK][KH_BLOCK][KW] = {};

        CellWalk at(r0, threadIdx.x, cells_w, H);
        for (index_t f = threadIdx.x; f < items; f += BLOCK) {
            const index_t n = at.n, ih = at.ih, iw = at.cell * CELLS;
            acc_t xv[IC_BLOCK][CELLS];
            const scalar_t* xp = x + ((n * CIN + g * CIN_G + icg0) * H + ih) * W + iw;
            read_cell(xv, true, icg0, iw, W, [&](int i, int c) { return xp + i * H * W + c; });

            bool col_ok[RW];
            window_columns(col_ok, iw, W_out, true);
#pragma unroll
            for (int kb = 0; kb < KH_BLOCK; ++kb) {
                const index_t oh = ih * SH - PH + (kh0 + kb) * DH;
                const bool row_ok = kh0 + kb < KH && oh >= 0 && oh < H_out;
#pragma unroll
                for (int o = 0; o < OC_BLOCK; ++o) {
                    const bool ok = row_ok && ocg0 + o < COUT_G;
                    const scalar_t* gp = grad_out + ((n * COUT + g * COUT_G + ocg0 + o) * H_out + oh) * W_out + iw * SW - PW;
                    acc_t gv[RW];
                    read_window<1>(gv, gp, ok, col_ok);
                    accumulate_row([&](int i, int kw) -> acc_t& { return acc[i][o][kb][kw]; }, xv, gv);
                }
            }

            at.advance(row_step, cell_step, cells_w, H);
        }

        // Apart from grad_weight_nhwc.cu's sum: every thread here holds the same weights, so warps reduce by shuffles.
#pragma unroll
        for (int i = 0; i < IC_BLOCK; ++i)
#pragma unroll
            for (int o = 0; o < OC_BLOCK; ++o)
#pragma unroll
                for (int kb = 0; kb < KH_BLOCK; ++kb)
#pragma unroll
                    for (int kw = 0; kw < KW; ++kw) {
                        const acc_t s = warp_sum(acc[i][o][kb][kw]);
                        if (lane == 0) warp_partials[warp][((i * OC_BLOCK + o) * KH_BLOCK + kb) * KW + kw] = s;
                    }
        __syncthreads();
        for (int v = threadIdx.x; v < VALUES; v += BLOCK) {
            const int i = v / (OC_BLOCK * KH_BLOCK * KW), o = v / (KH_BLOCK * KW) % OC_BLOCK;
            const int kh = kh0 + v / KW % KH_BLOCK, kw = v % KW;
            if (icg0 + i < CIN_G && ocg0 + o < COUT_G && kh < KH) {
                acc_t s = acc_t(0);
#pragma unroll
                for (int k = 0; k < WARPS; ++k) s += warp_partials[k][v];
                const index_t e = weight_index(g * CIN_G + icg0 + i, ocg0 + o, kh, kw);
                store(partial + static_cast<index_t>(blockIdx.x) * (static_cast<index_t>(CIN) * COUT_G * KH * KW) + e, s);
            }
        }
        __syncthreads();
    }
}
