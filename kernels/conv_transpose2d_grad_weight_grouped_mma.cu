// grad_weight of a grouped transposed convolution with few channels a group, on
// mma.sync tensor cores, channels_last 16-bit data; first pass of the same
// deterministic split-K as the direct kernels (fixed chunks of (n, ih) rows per
// blockIdx.x, one partial per weight element, reduce_partials.cu adding them in order).
//
// Per group and tap it is a GEMM with M = output channels, N = input channels and
// K = input pixels, too thin for the implicit GEMM (8 channels a side waste most of
// its tiles) and, done tap by tap, a re-read of every pixel for every tap.  Here a
// block stages one segment of SEG input pixels of a row, for GROUPS_PER_BLOCK whole
// groups, and the grad_output columns those pixels meet on every kernel row, once;
// every tap then reads its A fragments out of the same staged rows (ldmatrix takes
// a row address per lane, so the tap's stride and dilation are only addresses).
//
// A warp owns 16 output channels x 8 input channels of one group for every tap:
// TAPS x 4 fp32 accumulators.  Warps are (group, 16-channel block, 8-channel block)
// of the block's groups, so each writes its own weight elements and nothing is
// reduced between warps.
#include "layer.cuh"
#include "mma.cuh"
#include "cp_async_pipeline.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int GROUPS_PER_BLOCK = {{GROUPS_PER_BLOCK}};
constexpr int SEG = {{SEG}};  // input pixels of a row staged together, in whole k16 steps
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
typedef PartialOut<SINGLE_CHUNK, scalar_t, float>::type partial_t;

constexpr int OC_BLOCKS = COUT_G / 16, IC_BLOCKS = CIN_G / 8;
constexpr int WARPS_PER_GROUP = OC_BLOCKS * IC_BLOCKS;
constexpr int THREADS = GROUPS_PER_BLOCK * WARPS_PER_GROUP * 32;
constexpr int SPAN = (SEG - 1) * SW + (KW - 1) * DW + 1;  // grad_output columns a segment meets on a kernel row
// Staged rows in 16-byte units (8 channels); an odd pitch puts the eight rows of an
// ldmatrix phase on distinct banks (grad_output's rows step by SW: odd SW too).
constexpr int X_UNITS = GROUPS_PER_BLOCK * CIN_G / 8, G_UNITS = GROUPS_PER_BLOCK * COUT_G / 8;
constexpr int X_PITCH = X_UNITS | 1, G_PITCH = G_UNITS | 1;
constexpr int X_STAGE = SEG * X_PITCH, G_STAGE = SPAN * G_PITCH;  // 16-byte units
constexpr int STAGE_UNITS = X_STAGE + KH * G_STAGE;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "16-bit operands");
static_assert(COUT_G % 16 == 0 && CIN_G % 8 == 0, "whole 16 x 8 mma tiles of a group's channels");
static_assert(SEG % 16 == 0, "whole k16 steps of pixels");
static_assert(THREADS <= 1024, "one warp per 16 x 8 tile of the block's groups");

extern "C" __global__ void __launch_bounds__(THREADS)
conv_transpose2d_grad_weight_grouped_mma(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                         partial_t* __restrict__ partial, index_t N, index_t H, index_t W,
                                         index_t H_out, index_t W_out, index_t segs_w, index_t rows_per_chunk) {
    extern __shared__ __align__(16) unsigned char staged[];  // [SEG][X_PITCH] x, then KH x [SPAN][G_PITCH] grad_output
    const unsigned x_base = smem_addr(staged), g_base = x_base + X_STAGE * 16;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g0 = blockIdx.y * GROUPS_PER_BLOCK;
    const int local_group = warp / WARPS_PER_GROUP;
    const int oc_block = warp % WARPS_PER_GROUP / IC_BLOCKS, ic_block = warp % IC_BLOCKS;
    const bool has_group = g0 + local_group < GROUPS;
    // Units of the block's staged channels that stay inside the layer (the last block may hold fewer groups).
    const int groups_here = GROUPS - g0 < GROUPS_PER_BLOCK ? GROUPS - g0 : GROUPS_PER_BLOCK;
    const int x_units = groups_here * CIN_G / 8, g_units = groups_here * COUT_G / 8;

    const index_t r0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
    const index_t r1 = r0 + rows_per_chunk < N * H ? r0 + rows_per_chunk : N * H;
    const index_t items = (r1 - r0) * segs_w;

    // Each lane's ldmatrix row: B (x) rows are pixels 0-15 of a k step (lanes 16-31 repeat them); A (grad_output)
    // matrices are (pixels 0-7 | 8-15) x (output channels 0-7 | 8-15) in the order of the mma's A fragment.
    const int b_pixel = lane & 15;
    const unsigned b_unit = local_group * (CIN_G / 8) + ic_block;
    const int a_pixel = (lane & 7) + ((lane >> 4) << 3);
    const unsigned a_unit = local_group * (COUT_G / 8) + oc_block * 2 + ((lane >> 3) & 1);

    float acc[TAPS][4] = {};

    for (index_t item = 0; item < items; ++item) {
        const index_t row = r0 + item / segs_w;
        const index_t n = row / H, ih = row % H;
        const index_t iw0 = (item % segs_w) * SEG;
        bool row_ok[KH];
        for (int v = tid; v < SEG * X_UNITS; v += THREADS) {
            const int p = v / X_UNITS, u = v % X_UNITS;
            const bool ok = iw0 + p < W && u < x_units;
            cp_async_16(x_base + (p * X_PITCH + u) * 16,
                        ok ? x + ((n * H + ih) * W + iw0 + p) * CIN + g0 * CIN_G + u * 8 : x, ok);
        }
#pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
            const index_t oh = ih * SH - PH + kh * DH;
            row_ok[kh] = oh >= 0 && oh < H_out;
            const index_t ow0 = iw0 * SW - PW;
            for (int v = tid; v < SPAN * G_UNITS; v += THREADS) {
                const int q = v / G_UNITS, u = v % G_UNITS;
                const bool ok = row_ok[kh] && ow0 + q >= 0 && ow0 + q < W_out && u < g_units;
                cp_async_16(g_base + (kh * G_STAGE + q * G_PITCH + u) * 16,
                            ok ? grad_out + ((n * H_out + oh) * W_out + ow0 + q) * COUT + g0 * COUT_G + u * 8
                               : grad_out, ok);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        if (has_group) {
#pragma unroll
            for (int s = 0; s < SEG / 16; ++s) {
                unsigned b[2];
                ldmatrix_x2_trans(b, x_base + ((s * 16 + b_pixel) * X_PITCH + b_unit) * 16);
#pragma unroll
                for (int kh = 0; kh < KH; ++kh) {
                    if (!row_ok[kh]) continue;  // the same for the whole block
#pragma unroll
                    for (int kw = 0; kw < KW; ++kw) {
                        unsigned a[4];
                        const int column = (s * 16 + a_pixel) * SW + kw * DW;
                        ldmatrix_x4_trans(a, g_base + (kh * G_STAGE + column * G_PITCH + a_unit) * 16);
                        mma_16x8<KIND>(acc[kh * KW + kw], a, b);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with the stage before the next item overwrites it
    }

    if (!has_group) return;
    // C fragment: rows (output channels) lane / 4 and lane / 4 + 8, columns (input channels) 2 (lane % 4) + {0, 1}.
    partial_t* out = partial + static_cast<index_t>(blockIdx.x) * (static_cast<index_t>(CIN) * COUT_G * TAPS);
    const int ocg = oc_block * 16 + lane / 4;
    const index_t ic = static_cast<index_t>(g0 + local_group) * CIN_G + ic_block * 8 + (lane % 4) * 2;
#pragma unroll
    for (int t = 0; t < TAPS; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) store(out + weight_index(ic + e % 2, ocg + e / 2 * 8, t), acc[t][e]);
}
