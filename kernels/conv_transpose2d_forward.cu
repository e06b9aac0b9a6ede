// Transposed-convolution forward as a gather, decomposed by stride phase
// (forward_phases.cuh): each thread owns CELLS adjacent (q_h, q_w) cells and
// produces all SH*SW outputs of each, so every tap is used exactly once, none is
// tested and discarded, and the inner loop has no division or modulo.
//
// The loops are built to spend about one instruction per multiply-add: the
// block's weights sit in shared memory as padded rows read with broadcast vector
// loads, each input value is loaded once per cell row into a register window
// that all taps and all CELLS cells share, and OC_BLOCK output channels reuse
// every input load.
//
// A thread's outputs in one output row are a run of RUN = CELLS*SW adjacent
// columns, so a warp's plain stores would be strided by RUN and touch RUN times
// the sectors they fill.  With STAGE_STORES each warp passes its runs through
// shared memory and stores them as whole, contiguous warp-wide rows instead.
#include "layer.cuh"
#include "direct.cuh"
#include "forward_phases.cuh"

constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int OC_BLOCK = {{OC_BLOCK}};  // output channels per thread
constexpr int CELLS = {{CELLS}};        // adjacent low-resolution columns per thread
constexpr int IC_CHUNK = {{IC_CHUNK}};  // input channels whose weights are staged at a time
constexpr int BLOCK = {{BLOCK}};
constexpr int OC_BLOCKS = (COUT_G + OC_BLOCK - 1) / OC_BLOCK;
constexpr int VEC = SmemVector<acc_t>::WIDTH;
constexpr int ROW = (KW * OC_BLOCK + VEC - 1) / VEC * VEC;  // weights of one kernel row, [kw][o]
constexpr int RW = BW + CELLS;                              // input columns the CELLS cells read
constexpr int RUN = CELLS * SW;
constexpr bool STAGE_STORES = {{STAGE_STORES}};
constexpr int STAGE_WARPS = STAGE_STORES ? BLOCK / 32 : 1;

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_forward(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                         const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                         index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                         index_t q_h0, index_t q_w0, index_t QH, index_t QW, index_t cells_w) {
    __shared__ __align__(16) acc_t ws[IC_CHUNK * KH * ROW];
    __shared__ acc_t staged[STAGE_WARPS][STAGE_STORES ? 33 * RUN : 1];  // skewed: see below
    // Threads past the end stay to help stage weights, and neither load nor store.
    const index_t t = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x;
    const bool active = t < QH * cells_w;
    const index_t qh = q_h0 + (active ? t / cells_w : 0);
    const index_t qw = q_w0 + (active ? t % cells_w : 0) * CELLS;

    const Window<RH, RW, -1, 1> window(active, qh, H, qw - BW, W);

    for (int ocb = blockIdx.y; ocb < GROUPS * OC_BLOCKS; ocb += gridDim.y) {
        const int g = ocb / OC_BLOCKS;
        const int ocg0 = (ocb % OC_BLOCKS) * OC_BLOCK;
        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[CELLS][SH][SW][OC_BLOCK];
            fill_phases(acc, [&](int o) {
                return HAS_BIAS && ocg0 + o < COUT_G ? static_cast<acc_t>(load(bias + g * COUT_G + ocg0 + o)) : acc_t(0);
            });

            const scalar_t* xg = x + (n * CIN + g * CIN_G) * H * W;
            for (int ic0 = 0; ic0 < CIN_G; ic0 += IC_CHUNK) {
                stage_weight_rows<IC_CHUNK, OC_BLOCK, ROW, BLOCK>(ws, [&](int icl, int o, int kh, int kw) {
                    const int ic = ic0 + icl, ocg = ocg0 + o;
                    return ic < CIN_G && ocg < COUT_G ? static_cast<acc_t>(load(w + weight_index(g * CIN_G + ic, ocg, kh, kw)))
                                                      : acc_t(0);
                });
                const int chunk = CIN_G - ic0 < IC_CHUNK ? CIN_G - ic0 : IC_CHUNK;
                for (int icl = 0; icl < chunk; ++icl) {
                    const scalar_t* xc = xg + static_cast<index_t>(ic0 + icl) * H * W;
                    // Apart from forward_nhwc.cu's tap loop: here one broadcast load brings a whole kernel row of weights.
                    for_each_tap_row(window, xc, [&](const acc_t (&xv)[RW], int kh) {
                        acc_t wr[ROW];
                        load_smem_row(wr, ws + (icl * KH + kh) * ROW);
#pragma unroll
                        for (int kw = 0; kw < KW; ++kw) accumulate_tap(acc, xv, wr + kw * OC_BLOCK, kh, kw);
                    });
                }
            }

            if (STAGE_STORES) {
                const int lane = threadIdx.x % 32;
                acc_t* buf = staged[threadIdx.x / 32];
#pragma unroll
                for (int rh = 0; rh < SH; ++rh) {
                    const index_t oh = qh * SH + rh - PH;
                    const bool row_ok = active && oh >= 0 && oh < H_out;
                    const index_t row_base = ((n * COUT + g * COUT_G) * H_out + oh) * W_out;
                    const index_t run_start = qw * SW - PW;
                    // Element m*32 + lane of the warp's runs belongs to lane (m*32 + lane) / RUN.
                    index_t dst[RUN];
#pragma unroll
                    for (int m = 0; m < RUN; ++m) {
                        // Every lane takes part in every shuffle: none sits behind a condition.
                        const int e = m * 32 + lane, owner = e / RUN;
                        const index_t ow = __shfl_sync(0xffffffffu, run_start, owner) + e % RUN;
                        const int owner_row_ok = __shfl_sync(0xffffffffu, static_cast<int>(row_ok), owner);
                        const index_t owner_row = __shfl_sync(0xffffffffu, row_base, owner);
                        dst[m] = owner_row_ok && ow >= 0 && ow < W_out ? owner_row + ow : index_t(-1);
                    }
#pragma unroll
                    for (int o = 0; o < OC_BLOCK; ++o) {
                        if (ocg0 + o >= COUT_G) break;
#pragma unroll
                        for (int c = 0; c < CELLS; ++c)
#pragma unroll
                            for (int rw = 0; rw < SW; ++rw) {
                                // One word of skew per 32 keeps both the run writes and the row reads free of bank conflicts.
                                const int e = lane * RUN + c * SW + rw;
                                buf[e + e / 32] = acc[c][rh][rw][o];
                            }
                        __syncwarp();
                        const index_t plane = static_cast<index_t>(ocg0 + o) * H_out * W_out;
#pragma unroll
                        for (int m = 0; m < RUN; ++m)
                            if (dst[m] >= 0) store(y + plane + dst[m], buf[m * 33 + lane]);
                        __syncwarp();
                    }
                }
                continue;
            }
            if (!active) continue;
            for_each_output<CELLS>(qh, qw, H_out, W_out, [&](int c, int rh, int rw, index_t oh, index_t ow) {
#pragma unroll
                for (int o = 0; o < OC_BLOCK; ++o) {
                    if (ocg0 + o >= COUT_G) continue;
                    const index_t oc = g * COUT_G + ocg0 + o;
                    store(y + ((n * COUT + oc) * H_out + oh) * W_out + ow, acc[c][rh][rw][o]);
                }
            });
        }
    }
}
