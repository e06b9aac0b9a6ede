// Transposed-convolution forward on channels_last (NHWC) memory, by stride phase.
//
// The phase decomposition is the NCHW kernel's (forward_phases.cuh): a thread
// owns CELLS adjacent (q_h, q_w) cells and every tap is used once.
// What changes is which way the lanes run.  In NHWC a pixel's channels are
// adjacent, so threads are (cell run, channel lane) with the lane fastest and
// each lane owning OCB adjacent output channels of one group.  A warp stores
// whole channel runs of y; each input value it loads (one address per group of
// lanes) feeds OCB channels, and each tap's OCB weights come in one shared
// memory vector load, which keeps the instruction count near one per
// multiply-add for grouped layers as well as depthwise ones (OCB = 1).
//
// The block's weights sit in shared memory as [ic][tap][channel of the tile].
// When one chunk holds all of a group's input channels they are staged once and
// serve every image the block walks (blockIdx.z strides over the batch).
#include "layer.cuh"
#include "direct.cuh"
#include "forward_phases.cuh"

constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int OC_TILE = {{OC_TILE}};    // output channels of a block
constexpr int OCB = {{OCB}};            // adjacent output channels per thread; divides COUT_G and OC_TILE
constexpr int RUNS = {{RUNS}};          // cell runs of a block
constexpr int CELLS = {{CELLS}};        // adjacent low-resolution columns per thread
constexpr int IC_CHUNK = {{IC_CHUNK}};  // input channels whose weights are staged at a time
constexpr int LANES = OC_TILE / OCB;
constexpr int BLOCK = LANES * RUNS;
constexpr bool ONE_CHUNK = IC_CHUNK >= CIN_G;
constexpr int RW = BW + CELLS;                // input columns the CELLS cells read
static_assert(COUT_G % OCB == 0 && OC_TILE % OCB == 0, "a thread's channels lie in one group and one tile");

// ws[icl][tap][o] = w[ic0 + icl, channel oc0 + o, tap], zero past the ends.
__device__ __forceinline__ void stage_weights(acc_t* ws, const scalar_t* __restrict__ w, int ic0, int oc0) {
    stage_weight_taps<IC_CHUNK, OC_TILE, BLOCK>(ws, [&](int icl, int tap, int t) {
        const int ic = ic0 + icl, o = oc0 + t;
        // Each channel of the tile reads the weights of its own group.
        return ic < CIN_G && o < COUT ? static_cast<acc_t>(load(w + weight_index((o / COUT_G) * CIN_G + ic, o % COUT_G, tap)))
                                      : acc_t(0);
    });
}

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_forward_nhwc(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                              const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                              index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                              index_t q_h0, index_t q_w0, index_t QH, index_t QW, index_t cells_w) {
    __shared__ __align__(16) acc_t ws[IC_CHUNK * TAPS * OC_TILE];
    const int lane = threadIdx.x % LANES;
    // Threads past the end (in cells or in channels) stay to help stage weights.
    const index_t run = static_cast<index_t>(blockIdx.x) * RUNS + threadIdx.x / LANES;
    const bool active = run < QH * cells_w;
    const index_t qh = q_h0 + (active ? run / cells_w : 0);
    const index_t qw = q_w0 + (active ? run % cells_w : 0) * CELLS;

    const Window<RH, RW, -1, CIN> window(active, qh, H, qw - BW, W);

    for (int tile = blockIdx.y; tile * OC_TILE < COUT; tile += gridDim.y) {
        const int oc0 = tile * OC_TILE;
        const int oc = oc0 + lane * OCB;  // the first of the thread's OCB channels
        const bool oc_ok = oc < COUT;
        const int g = (oc_ok ? oc : COUT - 1) / COUT_G;
        if (ONE_CHUNK) stage_weights(ws, w, 0, oc0);
        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[CELLS][SH][SW][OCB];
            fill_phases(acc, [&](int o) { return HAS_BIAS && oc_ok ? static_cast<acc_t>(load(bias + oc + o)) : acc_t(0); });

            const scalar_t* xg = x + n * H * W * CIN + g * CIN_G;
            for (int ic0 = 0; ic0 < CIN_G; ic0 += IC_CHUNK) {
                if (!ONE_CHUNK) stage_weights(ws, w, ic0, oc0);
                const int chunk = CIN_G - ic0 < IC_CHUNK ? CIN_G - ic0 : IC_CHUNK;
                for (int icl = 0; icl < chunk; ++icl) {
                    const scalar_t* xc = xg + ic0 + icl;
                    const acc_t* wc = ws + icl * TAPS * OC_TILE + lane * OCB;
                    for_each_tap_row(window, xc, [&](const acc_t (&xv)[RW], int kh) {
                        // Apart from forward.cu's tap loop: here each tap's OCB weights come in their own vector.
#pragma unroll
                        for (int kw = 0; kw < KW; ++kw) {
                            acc_t wv[OCB];
                            load_smem_small(wv, wc + (kh * KW + kw) * OC_TILE);
                            accumulate_tap(acc, xv, wv, kh, kw);
                        }
                    });
                }
            }

            if (!active || !oc_ok) continue;
            for_each_output<CELLS>(qh, qw, H_out, W_out, [&](int c, int rh, int rw, index_t oh, index_t ow) {
                scalar_t* dst = y + ((n * H_out + oh) * W_out + ow) * COUT + oc;
#pragma unroll
                for (int o = 0; o < OCB; ++o) store(dst + o, acc[c][rh][rw][o]);
            });
        }
    }
}
