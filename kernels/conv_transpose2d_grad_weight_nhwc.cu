// grad_weight of a transposed convolution on channels_last (NHWC) memory, first
// pass of the same deterministic split-K as the NCHW kernel: fixed chunks of
// (n, ih) rows per blockIdx.x, a fixed-order reduction inside each block, one
// partial per weight element, and reduce_partials.cu summing the chunks in order.
//
// Lanes run along output channels: threads are (pixel stream, output channel)
// with the channel fastest, so each grad_output load of a warp is a whole
// channel run and each input load is one address per group of lanes.  A thread
// keeps IC_BLOCK x KH_BLOCK x KW accumulators for its output channel and takes
// CELLS adjacent pixels a step, sharing one grad_output window per kernel row.
#include "layer.cuh"
#include "grad_weight_cells.cuh"

constexpr int OC_TILE = {{OC_TILE}};    // output channels of a block, one per thread
constexpr int RUNS = {{RUNS}};          // pixel streams of a block
constexpr int IC_BLOCK = {{IC_BLOCK}};  // input channels per thread
constexpr int KH_BLOCK = {{KH_BLOCK}};  // kernel rows per thread; blockIdx.z picks which
constexpr int CELLS = {{CELLS}};        // adjacent input pixels per step
constexpr int BLOCK = OC_TILE * RUNS;
constexpr int IC_BLOCKS = (CIN_G + IC_BLOCK - 1) / IC_BLOCK;
constexpr int OC_TILES = (COUT_G * GROUPS + OC_TILE - 1) / OC_TILE;
constexpr int VALUES = IC_BLOCK * KH_BLOCK * KW;
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};  // one chunk: write grad_weight itself
typedef PartialOut<SINGLE_CHUNK, scalar_t, acc_t>::type partial_t;
constexpr int RW = (CELLS - 1) * SW + (KW - 1) * DW + 1;  // grad_output columns the CELLS pixels read

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_weight_nhwc_partial(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                          partial_t* __restrict__ partial,
                                          index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                                          index_t cells_w, index_t rows_per_chunk) {
    __shared__ acc_t stream_sums[RUNS][VALUES][OC_TILE];
    const int lane_oc = threadIdx.x % OC_TILE;
    const int stream = threadIdx.x / OC_TILE;
    const index_t r0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
    const index_t r1 = r0 + rows_per_chunk < N * H ? r0 + rows_per_chunk : N * H;
    const index_t items = (r1 - r0) * cells_w;
    // A stream's walk over its items advances by RUNS cells at a time.
    const index_t row_step = RUNS / cells_w, cell_step = RUNS % cells_w;
    const int kh0 = blockIdx.z * KH_BLOCK;

    for (int yb = blockIdx.y; yb < OC_TILES * IC_BLOCKS; yb += gridDim.y) {
        const int oc = yb / IC_BLOCKS * OC_TILE + lane_oc;
        const bool oc_ok = oc < COUT;
        const int g = (oc_ok ? oc : COUT - 1) / COUT_G;
        const int icg0 = yb % IC_BLOCKS * IC_BLOCK;

        acc_t acc[IC_BLOCK][KH_BLOCK][KW] = {};

        CellWalk at(r0, stream, cells_w, H);
        for (index_t f = stream; f < items; f += RUNS) {
            const index_t n = at.n, ih = at.ih, iw = at.cell * CELLS;
            acc_t xv[IC_BLOCK][CELLS];
            const scalar_t* xp = x + ((n * H + ih) * W + iw) * CIN + g * CIN_G + icg0;
            read_cell(xv, oc_ok, icg0, iw, W, [&](int i, int c) { return xp + c * CIN + i; });

            bool col_ok[RW];
            window_columns(col_ok, iw, W_out, oc_ok);
#pragma unroll
            for (int kb = 0; kb < KH_BLOCK; ++kb) {
                const index_t oh = ih * SH - PH + (kh0 + kb) * DH;
                const bool row_ok = kh0 + kb < KH && oh >= 0 && oh < H_out;
                const scalar_t* gp = grad_out + ((n * H_out + oh) * W_out + iw * SW - PW) * COUT + oc;
                acc_t gv[RW];
                read_window<COUT>(gv, gp, row_ok, col_ok);
                accumulate_row([&](int i, int kw) -> acc_t& { return acc[i][kb][kw]; }, xv, gv);
            }

            at.advance(row_step, cell_step, cells_w, H);
        }

        // Apart from grad_weight.cu's sum: lanes hold different output channels, so only streams are added.
#pragma unroll
        for (int i = 0; i < IC_BLOCK; ++i)
#pragma unroll
            for (int kb = 0; kb < KH_BLOCK; ++kb)
#pragma unroll
                for (int kw = 0; kw < KW; ++kw) stream_sums[stream][(i * KH_BLOCK + kb) * KW + kw][lane_oc] = acc[i][kb][kw];
        __syncthreads();
        for (int v = threadIdx.x; v < VALUES * OC_TILE; v += BLOCK) {
            const int value = v / OC_TILE, o = yb / IC_BLOCKS * OC_TILE + v % OC_TILE;
            const int i = value / (KH_BLOCK * KW), kh = kh0 + value / KW % KH_BLOCK, kw = value % KW;
            if (o < COUT && icg0 + i < CIN_G && kh < KH) {
                acc_t s = acc_t(0);
#pragma unroll
                for (int k = 0; k < RUNS; ++k) s += stream_sums[k][value][v % OC_TILE];
                const index_t e = weight_index((o / COUT_G) * CIN_G + icg0 + i, o % COUT_G, kh, kw);
                store(partial + static_cast<index_t>(blockIdx.x) * (static_cast<index_t>(CIN) * COUT_G * KH * KW) + e, s);
            }
        }
        __syncthreads();
    }
}
