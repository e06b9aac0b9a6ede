// Forward and grad_input of a depthwise transposed convolution (one input and one output channel a group) on
// channels_last tensors, built to move bytes: each thread takes VEC neighbouring channels (one 16-byte run) of a
// ROWS x COLS patch of destination pixels, so every load and store is a 16-byte run of a pixel's channels, and a
// warp's runs of neighbouring channels cover whole 128-byte lines.  Both passes gather from a source ("src")
// into a destination ("dst"):
//   forward (MODE 0): src = x, dst = y.  A patch starts on a whole stride period (ROWS and COLS are multiples of
//     SH and SW), so which taps feed each of its pixels, and the input pixel each reads, are compile-time
//     constants: patch row a, kernel row kh read input row i0 / SH + (a + PH - kh*DH) / SH where SH divides
//     a + PH - kh*DH.  The patch's input window (WIN_H x WIN_W pixels) is loaded once into registers, all its
//     loads in flight together, and each window pixel serves every tap that reads it.
//   grad_input (MODE 1): src = grad_out, dst = grad_in, a strided depthwise conv2d: grad_in row i reads
//     grad_out rows SH*i - PH + kh*DH for every tap.
// The block's taps (its channels' weights, widened) sit in shared memory as [tap][channel], so a thread reads a
// tap's VEC weights as whole vectors.  Sums are in fp32, in tap order.
#include "layer.cuh"

constexpr int MODE = {{MODE}};
constexpr int ROWS = {{ROWS}}, COLS = {{COLS}};   // destination pixels a thread: rows x columns
constexpr int VEC = {{VEC}};                      // channels a thread: an 8- or 16-byte run, or one
constexpr int CV_BLOCK = {{CV_BLOCK}};            // channel runs a block covers
constexpr int TILES_BLOCK = {{TILES_BLOCK}};      // patches a block covers, one a thread of each channel run
constexpr int BLOCK = CV_BLOCK * TILES_BLOCK;
constexpr bool HAS_BIAS = {{HAS_BIAS}} && MODE == 0;
constexpr int C = CIN;
constexpr int BLOCK_CHANNELS = CV_BLOCK * VEC;

static_assert(CIN_G == 1 && COUT_G == 1, "depthwise: one input and one output channel a group");
static_assert(MODE == 1 || (ROWS % SH == 0 && COLS % SW == 0), "forward patches of whole stride periods");
static_assert(C % VEC == 0, "channels in whole runs");

__host__ __device__ constexpr int floor_div(int a, int b) { return (a >= 0 ? a : a - b + 1) / b; }
// Whether kernel tap k feeds patch position a along one axis, and the source pixel it reads there, relative to
// the patch's source origin (forward: i0 / S; grad_input: S*i0 - P).
__host__ __device__ constexpr bool feeds(int a, int k, int s, int p, int d) {
    return MODE == 1 || ((a + p - k * d) % s + s) % s == 0;
}
__host__ __device__ constexpr int source_offset(int a, int k, int s, int p, int d) {
    return MODE == 0 ? floor_div(a + p - k * d, s) : a * s + k * d;
}
// The lowest and highest source offset any fed (position, tap) pair of an axis reads: the window's extent.
__host__ __device__ constexpr int reach(bool highest, int extent, int kernel, int s, int p, int d) {
    int found = highest ? -(1 << 30) : (1 << 30);
    for (int a = 0; a < extent; ++a)
        for (int k = 0; k < kernel; ++k)
            if (feeds(a, k, s, p, d)) {
                const int o = source_offset(a, k, s, p, d);
                found = highest ? (o > found ? o : found) : (o < found ? o : found);
            }
    return found;
}
constexpr int LOW_H = reach(false, ROWS, KH, SH, PH, DH), LOW_W = reach(false, COLS, KW, SW, PW, DW);
constexpr int WIN_H = reach(true, ROWS, KH, SH, PH, DH) - LOW_H + 1;
constexpr int WIN_W = reach(true, COLS, KW, SW, PW, DW) - LOW_W + 1;

typedef Run<scalar_t, VEC> Vector;
// grad_input walks the kernel's rows one at a time where every tap's loads at once would take more than 64
// registers: unrolled whole, a 7 x 7 kernel's 49 loads (bf16, sm_80) and two pixels' 16 taps of 16-byte runs
// spilled.  The forward needs its taps unrolled, their window places being compile-time constants.
constexpr int TAP_LOAD_WORDS = ROWS * COLS * ((VEC * static_cast<int>(sizeof(scalar_t)) + 3) / 4);
constexpr int KH_UNROLL = MODE == 0 || TAPS * TAP_LOAD_WORDS <= 64 ? KH : 1;

#if {{MODE}} == 0
#define BIAS_ARGUMENT const scalar_t* __restrict__ bias,
#else
#define BIAS_ARGUMENT
#endif

extern "C" __global__ void __launch_bounds__(BLOCK, {{MIN_BLOCKS}})
conv_transpose2d_depthwise_nhwc(const scalar_t* __restrict__ src, const scalar_t* __restrict__ w, BIAS_ARGUMENT
                                scalar_t* __restrict__ dst, index_t N, index_t H_SRC, index_t W_SRC, index_t H_DST,
                                index_t W_DST, index_t tiles_h, index_t tiles_w) {
    __shared__ __align__(16) acc_t taps_w[TAPS * BLOCK_CHANNELS];
    const int c_block = static_cast<int>(blockIdx.y) * BLOCK_CHANNELS;
    // Read in w's own order (a channel's taps are contiguous in either weight layout: one output channel a group).
    for (int i = threadIdx.x; i < TAPS * BLOCK_CHANNELS; i += BLOCK) {
        const int channel = i / TAPS, tap = i % TAPS;
        taps_w[tap * BLOCK_CHANNELS + channel] =
            c_block + channel < C ? static_cast<acc_t>(load(w + weight_index(c_block + channel, 0, tap))) : acc_t(0);
    }
    __syncthreads();

    const int run = static_cast<int>(threadIdx.x) % CV_BLOCK;
    const int c0 = c_block + run * VEC;
    const index_t tile = static_cast<index_t>(blockIdx.x) * TILES_BLOCK + threadIdx.x / CV_BLOCK;
    if (c0 >= C || tile >= N * tiles_h * tiles_w) return;
    const index_t n = tile / (tiles_h * tiles_w), at = tile % (tiles_h * tiles_w);
    const index_t i0 = at / tiles_w * ROWS, j0 = at % tiles_w * COLS;
    const index_t src_h0 = MODE == 0 ? i0 / SH : i0 * SH - PH, src_w0 = MODE == 0 ? j0 / SW : j0 * SW - PW;
    const scalar_t* src_n = src + n * H_SRC * W_SRC * C + c0;

    // A source pixel's run, zeros outside the source.
    auto source = [&](int dh, int dw) {
        const index_t h = src_h0 + dh, col = src_w0 + dw;
        Vector v;
        if (h >= 0 && h < H_SRC && col >= 0 && col < W_SRC) {
            v = load_run<VEC>(src_n + (h * W_SRC + col) * C);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) v.v[e] = scalar_t{};
        }
        return v;
    };

    acc_t acc[ROWS][COLS][VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        acc_t b = acc_t(0);
#if {{MODE}} == 0
        if constexpr (HAS_BIAS) b = static_cast<acc_t>(load(bias + c0 + e));
#endif
#pragma unroll
        for (int a = 0; a < ROWS; ++a)
#pragma unroll
            for (int q = 0; q < COLS; ++q) acc[a][q][e] = b;
    }

    // The forward's window, every load issued before the first multiply-add; grad_input's taps read their own
    // pixels (their offsets a*S + k*D rarely meet), each load just ahead of its use.
    Vector window[MODE == 0 ? WIN_H : 1][MODE == 0 ? WIN_W : 1];
    if constexpr (MODE == 0) {
#pragma unroll
        for (int r = 0; r < WIN_H; ++r)
#pragma unroll
            for (int q = 0; q < WIN_W; ++q) window[r][q] = source(LOW_H + r, LOW_W + q);
    }
#pragma unroll KH_UNROLL
    for (int kh = 0; kh < KH; ++kh)
#pragma unroll
        for (int kw = 0; kw < KW; ++kw) {
            acc_t wv[VEC];
            load_smem_small(wv, taps_w + (kh * KW + kw) * BLOCK_CHANNELS + run * VEC);
#pragma unroll
            for (int a = 0; a < ROWS; ++a)
#pragma unroll
                for (int q = 0; q < COLS; ++q) {
                    if (!feeds(a, kh, SH, PH, DH) || !feeds(q, kw, SW, PW, DW)) continue;
                    const int dh = source_offset(a, kh, SH, PH, DH), dw = source_offset(q, kw, SW, PW, DW);
                    const Vector v = MODE == 0 ? window[MODE == 0 ? dh - LOW_H : 0][MODE == 0 ? dw - LOW_W : 0]
                                               : source(dh, dw);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[a][q][e] += static_cast<acc_t>(widen(v.v[e])) * wv[e];
                }
        }

    scalar_t* dst_n = dst + n * H_DST * W_DST * C + c0;
#pragma unroll
    for (int a = 0; a < ROWS; ++a)
#pragma unroll
        for (int q = 0; q < COLS; ++q)
            if (i0 + a < H_DST && j0 + q < W_DST) store_run<VEC>(dst_n + ((i0 + a) * W_DST + j0 + q) * C, acc[a][q]);
}
