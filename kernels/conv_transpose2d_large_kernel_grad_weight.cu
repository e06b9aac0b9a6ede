// grad_weight of a transposed convolution for kernels of any size, first pass of a
// deterministic split-K:
//     grad_weight[ic, ocg, kh, kw] = sum over n, ih, iw of
//         x[n, ic, ih, iw] * grad_out[n, g*COUT_G + ocg, ih*SH - PH + kh*DH, iw*SW - PW + kw*DW]
// Threads split the taps, not the sum: a block owns ICB x OCB channel pairs of one group
// and a tile of TAP_ROWS kernel rows by TAP_COLS * KWB kernel columns, and each thread
// owns one kernel row and KWB adjacent columns of it for all the block's pairs.  Each
// thread walks its chunk of (n, ih) rows (blockIdx.x) pixel by pixel in a fixed order and
// writes one partial per weight element, with no atomics and no reduction between
// threads; reduce_partials.cu then sums the chunks in order (with a single chunk,
// SINGLE_CHUNK, the pass writes grad_weight itself).  So the result is bitwise
// reproducible, and registers and shared memory stay the same for any kernel size.
//
// The input pixels of a row are staged in shared memory TWX at a time, where every
// thread reads the same ones (broadcasts); a thread takes CELLS adjacent pixels a step,
// and its KWB columns share one window of RW grad_output values per output channel.
#include "layer.cuh"
#include "large_kernel.cuh"

constexpr bool CHANNELS_LAST = {{CHANNELS_LAST}};
constexpr int ICB = {{ICB}};            // input channels of a block
constexpr int OCB = {{OCB}};            // output channels of a block
constexpr int KWB = {{KWB}};            // adjacent kernel columns per thread
constexpr int TAP_COLS = {{TAP_COLS}};  // threads along kernel columns
constexpr int TAP_ROWS = {{TAP_ROWS}};  // threads along kernel rows, one row each
constexpr int CELLS = {{CELLS}};        // adjacent input pixels per step
constexpr int TWX = {{TWX}};            // input pixels staged at a time, a multiple of CELLS
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};  // one chunk: write grad_weight itself
typedef PartialOut<SINGLE_CHUNK, scalar_t, acc_t>::type partial_t;
constexpr int BLOCK = TAP_COLS * TAP_ROWS;
constexpr int TILE_KW = TAP_COLS * KWB;
constexpr int KH_TILES = (KH + TAP_ROWS - 1) / TAP_ROWS, KW_TILES = (KW + TILE_KW - 1) / TILE_KW;
constexpr int IC_BLOCKS = (CIN_G + ICB - 1) / ICB, OC_BLOCKS = (COUT_G + OCB - 1) / OCB;
constexpr int RW = (CELLS - 1) * SW + (KWB - 1) * DW + 1;  // grad_output columns of a step
static_assert(TWX % CELLS == 0, "a step's pixels come from one staged run");

// Four blocks an SM: at most 128 registers a thread, which the planned tilings fit without spilling.
extern "C" __global__ void __launch_bounds__(BLOCK, 4)
conv_transpose2d_large_kernel_grad_weight_partial(const scalar_t* __restrict__ x,
                                                  const scalar_t* __restrict__ grad_out,
                                                  partial_t* __restrict__ partial,
                                                  index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                                                  index_t rows_per_chunk) {
    __shared__ __align__(16) acc_t xs[TWX * ICB];  // xs[c][i]: pixel c of the run, input channel i
    const index_t r0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
    const index_t r1 = min_of(r0 + rows_per_chunk, N * H);
    const index_t weight_elems = static_cast<index_t>(CIN) * COUT_G * KH * KW;
    const int tap_row = threadIdx.x / TAP_COLS, tap_col = threadIdx.x % TAP_COLS;
    constexpr index_t GO_PITCH = CHANNELS_LAST ? COUT : 1;  // between neighbouring grad_output pixels

    for (int pair = blockIdx.z; pair < GROUPS * IC_BLOCKS * OC_BLOCKS; pair += gridDim.z) {
        const int g = pair / (IC_BLOCKS * OC_BLOCKS);
        const int icg0 = pair / OC_BLOCKS % IC_BLOCKS * ICB, ocg0 = pair % OC_BLOCKS * OCB;
        const index_t ic0 = static_cast<index_t>(g) * CIN_G + icg0, oc0 = static_cast<index_t>(g) * COUT_G + ocg0;

        for (int tile = blockIdx.y; tile < KH_TILES * KW_TILES; tile += gridDim.y) {
            const int kh_first = tile / KW_TILES * TAP_ROWS, kw_first = tile % KW_TILES * TILE_KW;
            const int kh_last = min_of(kh_first + TAP_ROWS, KH) - 1, kw_last = min_of(kw_first + TILE_KW, KW) - 1;
            const int kh = kh_first + tap_row, kw0 = kw_first + tap_col * KWB;
            // The input columns that meet some kernel column of the tile inside grad_output.
            const index_t iw_lo = max_of(ceil_div(static_cast<index_t>(PW) - static_cast<index_t>(kw_last) * DW, SW),
                                         index_t(0));
            const index_t iw_hi = min_of(floor_div(W_out - 1 + PW - static_cast<index_t>(kw_first) * DW, SW), W - 1);

            acc_t acc[ICB][OCB][KWB];
#pragma unroll
            for (int i = 0; i < ICB; ++i)
#pragma unroll
                for (int o = 0; o < OCB; ++o)
#pragma unroll
                    for (int b = 0; b < KWB; ++b) acc[i][o][b] = acc_t(0);

#pragma unroll 1
            for (index_t r = r0; r < r1; ++r) {
                const index_t n = r / H, ih = r % H;
                const index_t top = ih * SH - PH;  // grad_output row of kernel row 0
                // Rows that no kernel row of the tile maps inside grad_output are skipped by the whole block.
                const index_t kh_in = max_of(static_cast<index_t>(kh_first), ceil_div(-top, DH));
                if (kh_in > kh_last || top + kh_in * DH >= H_out) continue;
                const index_t oh = top + static_cast<index_t>(kh) * DH;
                const bool row_ok = kh <= kh_last && oh >= 0 && oh < H_out;
                const index_t at = row_ok ? oh : 0;  // a row outside is never read, nor pointed at
                const scalar_t* go_row = CHANNELS_LAST ? grad_out + (n * H_out + at) * W_out * COUT + oc0
                                                       : grad_out + (n * COUT + oc0) * H_out * W_out + at * W_out;
                const index_t go_channel = CHANNELS_LAST ? 1 : H_out * W_out;

#pragma unroll 1
                for (index_t iw0 = iw_lo; iw0 <= iw_hi; iw0 += TWX) {
                    __syncthreads();  // every thread is done with the previous run
                    for (int e = threadIdx.x; e < TWX * ICB; e += BLOCK) {
                        // Neighbouring threads read neighbouring addresses in either layout.
                        const int c = CHANNELS_LAST ? e / ICB : e % TWX, i = CHANNELS_LAST ? e % ICB : e / TWX;
                        const index_t iw = iw0 + c;
                        acc_t v = acc_t(0);
                        if (iw <= iw_hi && icg0 + i < CIN_G)
                            v = static_cast<acc_t>(load(x + (CHANNELS_LAST ? ((n * H + ih) * W + iw) * CIN + ic0 + i
                                                                           : ((n * CIN + ic0 + i) * H + ih) * W + iw)));
                        xs[c * ICB + i] = v;
                    }
                    __syncthreads();
                    if (!row_ok) continue;

                    const int steps = static_cast<int>(min_of(static_cast<index_t>(TWX), iw_hi + 1 - iw0));
#pragma unroll 1
                    for (int cb = 0; cb < steps; cb += CELLS) {
                        acc_t xv[CELLS][ICB];
#pragma unroll
                        for (int c = 0; c < CELLS; ++c) load_smem_small(xv[c], xs + (cb + c) * ICB);
                        // Window column j of pixel c and kernel column b is c * SW + b * DW.
                        const index_t col0 = (iw0 + cb) * SW - PW + static_cast<index_t>(kw0) * DW;
#pragma unroll
                        for (int o = 0; o < OCB; ++o) {
                            if (ocg0 + o >= COUT_G) break;
                            acc_t gv[RW];
#pragma unroll
                            for (int j = 0; j < RW; ++j) {
                                const index_t col = col0 + j;
                                gv[j] = col >= 0 && col < W_out
                                            ? static_cast<acc_t>(load(go_row + o * go_channel + col * GO_PITCH))
                                            : acc_t(0);
                            }
#pragma unroll
                            for (int b = 0; b < KWB; ++b)
#pragma unroll
                                for (int c = 0; c < CELLS; ++c)
#pragma unroll
                                    for (int i = 0; i < ICB; ++i) acc[i][o][b] += xv[c][i] * gv[c * SW + b * DW];
                        }
                    }
                }
            }

#pragma unroll
            for (int i = 0; i < ICB; ++i)
#pragma unroll
                for (int o = 0; o < OCB; ++o)
#pragma unroll
                    for (int b = 0; b < KWB; ++b)
                        if (kh <= kh_last && kw0 + b <= kw_last && icg0 + i < CIN_G && ocg0 + o < COUT_G)
                            store(partial + static_cast<index_t>(blockIdx.x) * weight_elems +
                                      weight_index(ic0 + i, ocg0 + o, kh, kw0 + b), acc[i][o][b]);
        }
    }
}
