// grad_input of a transposed convolution on channels_last (NHWC) memory: the
// ordinary convolution conv2d(grad_output, weight, stride, padding, dilation,
// groups), as a gather.
//
// As in the NCHW kernel each thread owns CELLS adjacent input pixels of a row
// and shares one grad_output window per kernel row between them, but here the
// lanes run along input channels: threads are (pixel run, channel lane) with
// the lane fastest and each lane owning ICB adjacent input channels of one
// group, so a warp stores whole channel runs, each grad_output value it loads
// (one address per group of lanes) feeds ICB channels, and each tap's ICB
// weights come in one shared-memory vector load.  The weights sit in shared
// memory as [oc][tap][channel of the tile]; when one chunk holds all of a
// group's output channels they are staged once for every image the block walks.
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
constexpr int IC_TILE = {{IC_TILE}};    // input channels of a block
constexpr int ICB = {{ICB}};            // adjacent input channels per thread; divides CIN_G and IC_TILE
constexpr int RUNS = {{RUNS}};          // pixel runs of a block
constexpr int CELLS = {{CELLS}};        // adjacent input pixels per thread
constexpr int OC_CHUNK = {{OC_CHUNK}};  // output channels whose weights are staged at a time
constexpr int LANES = IC_TILE / ICB;
constexpr int BLOCK = LANES * RUNS;
constexpr int TAPS = KH * KW;
constexpr int CIN = CIN_G * GROUPS;
constexpr int COUT = COUT_G * GROUPS;
constexpr int RW = (CELLS - 1) * SW + (KW - 1) * DW + 1;  // grad_output columns the CELLS pixels read
constexpr bool ONE_CHUNK = OC_CHUNK >= COUT_G;
static_assert(CIN_G % ICB == 0 && IC_TILE % ICB == 0, "a thread's channels lie in one group and one tile");

// ws[ocl][tap][i] = w[ic0 + i, oc0 + ocl, tap], zero past the ends.
__device__ __forceinline__ void stage_weights(acc_t* ws, const scalar_t* __restrict__ w, int oc0, int ic0) {
    for (int e = threadIdx.x; e < OC_CHUNK * TAPS * IC_TILE; e += BLOCK) {
        const int ocl = e / (TAPS * IC_TILE), tap = e / IC_TILE % TAPS, i = ic0 + e % IC_TILE;
        const int ocg = oc0 + ocl;
        ws[e] = ocg < COUT_G && i < CIN
                    ? static_cast<acc_t>(load(w + (static_cast<index_t>(i) * COUT_G + ocg) * TAPS + tap))
                    : acc_t(0);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_input_nhwc(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ w,
                                 scalar_t* __restrict__ grad_in,
                                 index_t N, index_t H, index_t W, index_t H_out, index_t W_out, index_t cells_w) {
    __shared__ __align__(16) acc_t ws[OC_CHUNK * TAPS * IC_TILE];
    const int lane = threadIdx.x % LANES;
    // Threads past the end (in pixels or in channels) stay to help stage weights.
    const index_t run = static_cast<index_t>(blockIdx.x) * RUNS + threadIdx.x / LANES;
    const bool active = run < H * cells_w;
    const index_t ih = active ? run / cells_w : 0;
    const index_t iw = (active ? run % cells_w : 0) * CELLS;

    index_t row_off[KH];
    bool row_ok[KH];
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) {
        const index_t oh = ih * SH - PH + kh * DH;
        row_ok[kh] = active && oh >= 0 && oh < H_out;
        row_off[kh] = oh * W_out * COUT;
    }
    index_t col[RW];
    bool col_ok[RW];
#pragma unroll
    for (int j = 0; j < RW; ++j) {
        const index_t ow = iw * SW - PW + j;
        col_ok[j] = ow >= 0 && ow < W_out;
        col[j] = ow * COUT;
    }

    for (int tile = blockIdx.y; tile * IC_TILE < CIN; tile += gridDim.y) {
        const int ic0 = tile * IC_TILE;
        const int ic = ic0 + lane * ICB;  // the first of the thread's ICB channels
        const bool ic_ok = ic < CIN;
        const int g = (ic_ok ? ic : CIN - 1) / CIN_G;
        if (ONE_CHUNK) {
            __syncthreads();  // every thread is done with the previous tile's weights
            stage_weights(ws, w, 0, ic0);
            __syncthreads();
        }
        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[CELLS][ICB];
#pragma unroll
            for (int c = 0; c < CELLS; ++c)
#pragma unroll
                for (int i = 0; i < ICB; ++i) acc[c][i] = acc_t(0);

            const scalar_t* gg = grad_out + n * H_out * W_out * COUT + g * COUT_G;
            for (int oc0 = 0; oc0 < COUT_G; oc0 += OC_CHUNK) {
                if (!ONE_CHUNK) {
                    __syncthreads();  // every thread is done with the previous chunk's weights
                    stage_weights(ws, w, oc0, ic0);
                    __syncthreads();
                }
                const int chunk = COUT_G - oc0 < OC_CHUNK ? COUT_G - oc0 : OC_CHUNK;
                for (int ocl = 0; ocl < chunk; ++ocl) {
                    const scalar_t* gc = gg + oc0 + ocl;
                    const acc_t* wc = ws + ocl * TAPS * IC_TILE + lane * ICB;
#pragma unroll
                    for (int kh = 0; kh < KH; ++kh) {
                        acc_t gv[RW];
#pragma unroll
                        for (int j = 0; j < RW; ++j)
                            gv[j] = row_ok[kh] && col_ok[j] ? static_cast<acc_t>(load(gc + row_off[kh] + col[j])) : acc_t(0);
#pragma unroll
                        for (int kw = 0; kw < KW; ++kw) {
                            acc_t wv[ICB];
                            load_smem_small(wv, wc + (kh * KW + kw) * IC_TILE);
#pragma unroll
                            for (int c = 0; c < CELLS; ++c)
#pragma unroll
                                for (int i = 0; i < ICB; ++i) acc[c][i] += gv[c * SW + kw * DW] * wv[i];
                        }
                    }
                }
            }

            if (!active || !ic_ok) continue;
            scalar_t* dst = grad_in + ((n * H + ih) * W + iw) * CIN + ic;
#pragma unroll
            for (int c = 0; c < CELLS; ++c)
                if (iw + c < W)
#pragma unroll
                    for (int i = 0; i < ICB; ++i) store(dst + c * CIN + i, acc[c][i]);
        }
    }
}
