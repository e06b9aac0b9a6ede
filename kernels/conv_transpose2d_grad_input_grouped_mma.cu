// grad_input of a grouped transposed convolution with few channels a group, on mma.sync
// tensor cores, channels_last 16-bit data.
//
//   grad_input[n, ih, iw, ic] = sum over taps and the group's output channels of
//       grad_out[n, ih * SH - PH + kh * DH, iw * SW - PW + kw * DW, oc] * w[ic, oc, kh, kw]
//
// Per tap a GEMM with M = input pixels, N = input channels and K = output channels.  A
// block takes a segment of SEG input pixels of one row for GROUPS_PER_BLOCK whole groups
// and stages the grad_output columns they meet on every kernel row (as the grouped
// grad_weight does), the next item's while it computes this one; a tap's A rows are the
// staged columns p * SW + kw * DW of 16 adjacent pixels (ldmatrix, a row address a lane).
// The block's weights stay in shared memory as [group][tap][input channel][output channel
// pairs] for every item it walks.  A warp takes 16 pixels of one group, every input
// channel, through every tap.  grad_output is channels_last (for an NCHW layer, a copy);
// grad_input is written channels_last, or NCHW where OUT_NCHW says.
#include "layer.cuh"
#include "mma.cuh"
#include "cp_async_pipeline.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int GROUPS_PER_BLOCK = {{GROUPS_PER_BLOCK}};
constexpr int SEG = {{SEG}};  // input pixels of a row a block computes at once, in whole 16-pixel tiles
constexpr int WARPS = {{WARPS}};
constexpr bool OUT_NCHW = {{OUT_NCHW}};
constexpr int THREADS = WARPS * 32;
constexpr int N_TILES = CIN_G / 8, K_STEPS = COUT_G / 16, TILES = SEG / 16;
constexpr int SPAN = (SEG - 1) * SW + (KW - 1) * DW + 1;  // grad_output columns a segment meets on a kernel row
// Staged grad_output rows in 16-byte units (8 channels); an odd pitch keeps ldmatrix's eight rows on distinct banks
// (they step by SW: for odd SW).
constexpr int G_UNITS = GROUPS_PER_BLOCK * COUT_G / 8, G_PITCH = G_UNITS | 1;
constexpr int G_BYTES = KH * SPAN * G_PITCH * 16;
// A weight row (one input channel of one tap) of COUT_G / 2 words and 4 more: the eight rows a B load reads, one a
// lane / 4, land on distinct banks.
constexpr int W_PITCH = COUT_G / 2 + 4;
constexpr int W_WORDS = GROUPS_PER_BLOCK * TAPS * CIN_G * W_PITCH;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "16-bit operands");
static_assert(COUT_G % 16 == 0 && CIN_G % 8 == 0, "whole k16 steps of output channels and 8-channel N tiles");
static_assert(SEG % 16 == 0, "whole 16-pixel tiles");

extern "C" __global__ void __launch_bounds__(THREADS)
conv_transpose2d_grad_input_grouped_mma(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ w,
                                        scalar_t* __restrict__ grad_in, index_t N, index_t H, index_t W,
                                        index_t H_out, index_t W_out, index_t segs) {
    extern __shared__ __align__(16) unsigned char staged[];  // two [KH][SPAN][G_PITCH] stages, then the weights
    unsigned* ws = reinterpret_cast<unsigned*>(staged + 2 * G_BYTES);
    const unsigned g_base = smem_addr(staged);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g0 = blockIdx.y * GROUPS_PER_BLOCK;
    const int groups_here = GROUPS - g0 < GROUPS_PER_BLOCK ? GROUPS - g0 : GROUPS_PER_BLOCK;
    const int g_units = groups_here * COUT_G / 8;

    for (int v = tid; v < GROUPS_PER_BLOCK * TAPS * CIN_G * (COUT_G / 2); v += THREADS) {
        const int pair = v % (COUT_G / 2), ic = v / (COUT_G / 2) % CIN_G, tap = v / (COUT_G / 2 * CIN_G) % TAPS;
        const int local_group = v / (COUT_G / 2 * CIN_G * TAPS), group = g0 + local_group;
        unsigned word = 0;
        if (group < GROUPS) {
            const index_t c = static_cast<index_t>(group) * CIN_G + ic;
            word = w[weight_index(c, 2 * pair, tap)].bits
                   | static_cast<unsigned>(w[weight_index(c, 2 * pair + 1, tap)].bits) << 16;
        }
        ws[((local_group * TAPS + tap) * CIN_G + ic) * W_PITCH + pair] = word;
    }

    // Which kernel rows meet grad_output inside the output, for input row ih.
    auto rows_of = [&](index_t ih, bool (&row_ok)[KH], index_t (&oh)[KH]) {
#pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
            oh[kh] = ih * SH - PH + kh * DH;
            row_ok[kh] = oh[kh] >= 0 && oh[kh] < H_out;
        }
    };
    // Starts the copies of an item's grad_output columns into stage s (one commit group, empty past the last item).
    auto issue = [&](index_t item, int s) {
        if (item < N * H * segs) {
            const index_t row = item / segs, iw0 = (item % segs) * SEG;
            const index_t n = row / H, ow0 = iw0 * SW - PW;
            bool row_ok[KH];
            index_t oh[KH];
            rows_of(row % H, row_ok, oh);
#pragma unroll
            for (int kh = 0; kh < KH; ++kh) {
                if (!row_ok[kh]) continue;  // the same for the whole block
                for (int v = tid; v < SPAN * G_UNITS; v += THREADS) {
                    const int q = v / G_UNITS, u = v % G_UNITS;
                    const bool ok = ow0 + q >= 0 && ow0 + q < W_out && u < g_units;
                    cp_async_16(g_base + s * G_BYTES + ((kh * SPAN + q) * G_PITCH + u) * 16,
                                ok ? grad_out + ((n * H_out + oh[kh]) * W_out + ow0 + q) * COUT + g0 * COUT_G + u * 8
                                   : grad_out, ok);
                }
            }
        }
        cp_async_commit();
    };

    // This lane's ldmatrix row of an A fragment: matrices (pixels 0-7 | 8-15) x (output channels 0-7 | 8-15), in
    // the order of the mma's A registers.
    const int a_pixel = (lane & 7) + ((lane >> 3) & 1) * 8, a_unit = lane >> 4;

    const index_t items = N * H * segs;
    issue(blockIdx.x, 0);
    int s = 0;
    for (index_t item = blockIdx.x; item < items; item += gridDim.x, s ^= 1) {
        // The next item's columns land while this one computes; its stage held the item before this one, which
        // every warp finished reading before the last __syncthreads.
        issue(item + gridDim.x, s ^ 1);
        const index_t row = item / segs, iw0 = (item % segs) * SEG;
        const index_t n = row / H, ih = row % H;
        bool row_ok[KH];
        index_t oh[KH];
        rows_of(ih, row_ok, oh);
        cp_async_wait<1>();
        __syncthreads();

        const unsigned stage = g_base + s * G_BYTES;
        for (int task = warp; task < GROUPS_PER_BLOCK * TILES; task += WARPS) {
            const int local_group = task / TILES, tile = task % TILES;
            if (local_group >= groups_here) continue;  // past the layer's groups
            float acc[N_TILES][4] = {};
            const unsigned a_rows = stage + ((tile * 16 + a_pixel) * SW * G_PITCH + local_group * (COUT_G / 8) + a_unit) * 16;
            const unsigned* w_group = ws + (local_group * TAPS * CIN_G + lane / 4) * W_PITCH + lane % 4;
#pragma unroll
            for (int kh = 0; kh < KH; ++kh) {
                if (!row_ok[kh]) continue;
#pragma unroll
                for (int kw = 0; kw < KW; ++kw) {
                    const unsigned a_tap = a_rows + (kh * SPAN + kw * DW) * G_PITCH * 16;
                    const unsigned* w_tap = w_group + (kh * KW + kw) * CIN_G * W_PITCH;
#pragma unroll
                    for (int ks = 0; ks < K_STEPS; ++ks) {
                        unsigned a[4];
                        ldmatrix_x4(a, a_tap + ks * 2 * 16);
#pragma unroll
                        for (int nt = 0; nt < N_TILES; ++nt) {
                            // B fragment: output channels 2 (lane % 4) + {0, 1} and 8 more, input channel lane / 4
                            const unsigned b[2] = {w_tap[nt * 8 * W_PITCH + ks * 8], w_tap[nt * 8 * W_PITCH + ks * 8 + 4]};
                            mma_16x8<KIND>(acc[nt], a, b);
                        }
                    }
                }
            }
            // C fragment: rows (pixels) lane / 4 and lane / 4 + 8 of the tile, input channels 2 (lane % 4) + {0, 1}.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const index_t iw = iw0 + tile * 16 + lane / 4 + h * 8;
                if (iw >= W) continue;
                const index_t c = static_cast<index_t>(g0 + local_group) * CIN_G + (lane % 4) * 2;
                if (OUT_NCHW) {
                    // A store puts 8 adjacent pixels of 4 channels, 16-byte halves of sectors the h = 1 store mostly fills.
                    scalar_t* dst = grad_in + ((n * CIN + c) * H + ih) * W + iw;
#pragma unroll
                    for (int nt = 0; nt < N_TILES; ++nt) {
                        store(dst + nt * 8 * H * W, acc[nt][2 * h]);
                        store(dst + (nt * 8 + 1) * H * W, acc[nt][2 * h + 1]);
                    }
                } else {
                    scalar_t* dst = grad_in + ((n * H + ih) * W + iw) * CIN + c;
#pragma unroll
                    for (int nt = 0; nt < N_TILES; ++nt) store_pair(dst + nt * 8, acc[nt][2 * h], acc[nt][2 * h + 1]);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before the issue after next overwrites it
    }
    cp_async_wait<0>();
}
