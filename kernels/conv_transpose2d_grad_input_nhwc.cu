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
//
// With OC_VEC > 1 a thread reads grad_output a 16-byte run of OC_VEC output
// channels at a time, tap by tap, instead of one channel's window row: the
// channel-by-channel loads bring 2 or 4 bytes of each 32-byte sector a warp
// touches, and every one of them is a load and a conversion for only
// CELLS * ICB multiply-adds.
#include "layer.cuh"
#include "direct.cuh"

constexpr int IC_TILE = {{IC_TILE}};    // input channels of a block
constexpr int ICB = {{ICB}};            // adjacent input channels per thread; divides CIN_G and IC_TILE
constexpr int RUNS = {{RUNS}};          // pixel runs of a block
constexpr int CELLS = {{CELLS}};        // adjacent input pixels per thread
constexpr int OC_CHUNK = {{OC_CHUNK}};  // output channels whose weights are staged at a time
constexpr int OC_VEC = {{OC_VEC}};      // output channels a grad_output load brings: 1, or a 16-byte run
constexpr int LANES = IC_TILE / ICB;
constexpr int BLOCK = LANES * RUNS;
constexpr int RW = (CELLS - 1) * SW + (KW - 1) * DW + 1;  // grad_output columns the CELLS pixels read
constexpr bool ONE_CHUNK = OC_CHUNK >= COUT_G;
static_assert(CIN_G % ICB == 0 && IC_TILE % ICB == 0, "a thread's channels lie in one group and one tile");
static_assert(OC_VEC == 1 || (COUT_G % OC_VEC == 0 && (ONE_CHUNK || OC_CHUNK % OC_VEC == 0)),
              "runs of output channels lie in one group and one staged chunk");

// ws[ocl][tap][i] = w[ic0 + i, oc0 + ocl, tap], zero past the ends.
__device__ __forceinline__ void stage_weights(acc_t* ws, const scalar_t* __restrict__ w, int oc0, int ic0) {
    stage_weight_taps<OC_CHUNK, IC_TILE, BLOCK>(ws, [&](int ocl, int tap, int t) {
        const int ocg = oc0 + ocl, i = ic0 + t;
        return ocg < COUT_G && i < CIN ? static_cast<acc_t>(load(w + weight_index(i, ocg, tap))) : acc_t(0);
    });
}

typedef Window<KH, RW, DH, COUT> GradOutWindow;

// acc[c][i] += the products of OC_VEC output channels' grad_output (from gc, the first of them at the window's
// origin) with their weights (wc: [oc][tap] rows of the tile, at the thread's first channel), tap by tap: each
// tap's CELLS runs are loaded, then each channel's ICB weights serve every cell.
__device__ __forceinline__ void add_channel_runs(acc_t (&acc)[CELLS][ICB], const GradOutWindow& window,
                                                 const scalar_t* gc, const acc_t* wc) {
#pragma unroll
    for (int kh = 0; kh < KH; ++kh) {
        if (!window.row_ok[kh]) continue;
#pragma unroll
        for (int kw = 0; kw < KW; ++kw) {
            acc_t gv[CELLS][OC_VEC];
#pragma unroll
            for (int c = 0; c < CELLS; ++c) {
                const int j = c * SW + kw * DW;
                if (window.col_ok[j]) {
                    const Run<scalar_t, OC_VEC> run =
                        load_run<OC_VEC>(gc + window.row_offset[kh] + window.col_offset[j]);
#pragma unroll
                    for (int v = 0; v < OC_VEC; ++v) gv[c][v] = static_cast<acc_t>(widen(run.v[v]));
                } else {
#pragma unroll
                    for (int v = 0; v < OC_VEC; ++v) gv[c][v] = acc_t(0);
                }
            }
#pragma unroll
            for (int v = 0; v < OC_VEC; ++v) {
                acc_t wv[ICB];
                load_smem_small(wv, wc + (v * TAPS + kh * KW + kw) * IC_TILE);
#pragma unroll
                for (int c = 0; c < CELLS; ++c)
#pragma unroll
                    for (int i = 0; i < ICB; ++i) acc[c][i] += gv[c][v] * wv[i];
            }
        }
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

    const GradOutWindow window(active, ih * SH - PH, H_out, iw * SW - PW, W_out);

    for (int tile = blockIdx.y; tile * IC_TILE < CIN; tile += gridDim.y) {
        const int ic0 = tile * IC_TILE;
        const int ic = ic0 + lane * ICB;  // the first of the thread's ICB channels
        const bool ic_ok = ic < CIN;
        const int g = (ic_ok ? ic : CIN - 1) / CIN_G;
        if (ONE_CHUNK) stage_weights(ws, w, 0, ic0);
        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[CELLS][ICB] = {};

            const scalar_t* gg = grad_out + n * H_out * W_out * COUT + g * COUT_G;
            for (int oc0 = 0; oc0 < COUT_G; oc0 += OC_CHUNK) {
                if (!ONE_CHUNK) stage_weights(ws, w, oc0, ic0);
                const int chunk = COUT_G - oc0 < OC_CHUNK ? COUT_G - oc0 : OC_CHUNK;
                if constexpr (OC_VEC > 1) {
                    for (int ocl = 0; ocl < chunk; ocl += OC_VEC)
                        add_channel_runs(acc, window, gg + oc0 + ocl, ws + ocl * TAPS * IC_TILE + lane * ICB);
                } else {
                    for (int ocl = 0; ocl < chunk; ++ocl) {
                        const scalar_t* gc = gg + oc0 + ocl;
                        const acc_t* wc = ws + ocl * TAPS * IC_TILE + lane * ICB;
                        window.for_each_row(gc, [&](const acc_t (&gv)[RW], int kh) {
                            // Apart from grad_input.cu's tap loop: here each tap's ICB weights come in their own
                            // vector.
#pragma unroll
                            for (int kw = 0; kw < KW; ++kw) {
                                acc_t wv[ICB];
                                load_smem_small(wv, wc + (kh * KW + kw) * IC_TILE);
#pragma unroll
                                for (int c = 0; c < CELLS; ++c)
#pragma unroll
                                    for (int i = 0; i < ICB; ++i) acc[c][i] += gv[c * SW + kw * DW] * wv[i];
                            }
                        });
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
