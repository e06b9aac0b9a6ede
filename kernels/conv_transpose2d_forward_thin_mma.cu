// The NCHW float32 forward of a transposed convolution with few output channels (an RGB generator's last layer)
// on the tensor cores as TF32 (mma.sync m16n8k8, sm_80+), one group.  Each output pixel of stride phase (a, b)
// gathers x from the input pixels that phase's taps reach: per phase a GEMM with M = the phase's output pixels,
// N = the output channels (up to 8, one n8 tile) and K = input channels x the phase's taps.  Where the direct
// kernels spend TAPS * COUT CUDA-core multiply-adds on each input value, the tensor cores take eight output
// channels at a time.
//
// A block computes a TH x TW output tile of one image, every phase: PR x 16 pixels a phase, one m16 tile per
// phase row.  It stages the input window those pixels read (HR x HC pixels), ICC input channels at a time, as
// [pixel][channel] rows of 80 bytes, rounded to TF32, and the chunk's weights as [tap][output channel][channel]
// rows; each tap's A fragments come through ldmatrix with a row address per pixel, so the window serves every
// tap where it lies.  A chunk's loads go out a chunk ahead, into registers, while the MMAs run; the tile leaves
// through shared memory as whole output rows.
#include "layer.cuh"
#include "mma.cuh"

constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int PR = {{PR}};                  // phase rows of a tile: m16 tiles a phase
constexpr int PC = 16;                      // phase columns of a tile: one m16 tile's rows
constexpr int ICC = TILE_K_WORDS;           // input channels a chunk: 64 bytes of K, two k8 steps
constexpr int NPH = SH * SW;                // stride phases
constexpr int TH = SH * PR, TW = SW * PC;   // the output tile
constexpr int WARPS = 4, THREADS = 32 * WARPS;
static_assert(PR % WARPS == 0, "each warp takes every WARPS-th phase row of every phase");
static_assert(COUT <= 8 && GROUPS == 1, "one n8 tile of output channels, one group");
constexpr int ROWS_A_WARP = PR / WARPS;

__host__ __device__ constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
// Input window of a tile, relative to its phase-grid origin: the lowest row a tap reaches (phase 0, the last
// tap) to the highest (the last phase, tap 0).
constexpr int HR0 = floor_div(PH - (KH - 1) * DH, SH), HR_TOP = floor_div(SH - 1 + PH, SH);
constexpr int HC0 = floor_div(PW - (KW - 1) * DW, SW), HC_TOP = floor_div(SW - 1 + PW, SW);
constexpr int HR = PR + HR_TOP - HR0, HC = PC + HC_TOP - HC0;
constexpr int WINDOW = HR * HC;
constexpr int PITCH = ROW_WORDS;            // 80-byte rows: conflict-free ldmatrix phases
constexpr int WINDOW_WORDS = WINDOW * PITCH, WEIGHT_WORDS = TAPS * 8 * PITCH;
constexpr int STAGE_WORDS = WINDOW_WORDS + WEIGHT_WORDS;
constexpr int WINDOW_EIGHTS = (WINDOW + 7) / 8;
constexpr int OUT_WORDS = COUT * TH * TW;

// Whether tap row kh feeds phase row a (kh's offset from the phase lands on a whole input row), and which window
// row it reads for phase row 0.
__host__ __device__ constexpr bool feeds(int a, int k, int p, int d, int s) {
    return ((a + p - k * d) % s + s) % s == 0;
}
__host__ __device__ constexpr int window_offset(int a, int k, int p, int d, int s, int origin) {
    return (a + p - k * d) / s - origin;
}

__device__ __forceinline__ float tf32_rounded(float v) { return __uint_as_float(to_tf32(__float_as_uint(v))); }

// A chunk's loads, held in registers from load() to store(): a warp takes eight window pixels by four channels a
// load (32-byte runs of a row of x, and stores that fall on 32 distinct banks), every WARPS-th eight of the
// window, all ICC channels of them; then a share of the chunk's weights.
constexpr int EIGHTS_A_WARP = (WINDOW_EIGHTS + WARPS - 1) / WARPS;
constexpr int WEIGHT_LOADS = (TAPS * COUT * ICC + THREADS - 1) / THREADS;

struct ChunkLoads {
    float window[EIGHTS_A_WARP][ICC / 4];
    float weight[WEIGHT_LOADS];

    __device__ __forceinline__ void load(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w, int n,
                                         int ic0, index_t ih0, index_t iw0, index_t H, index_t W) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        const index_t plane = H * W;
#pragma unroll
        for (int q = 0; q < EIGHTS_A_WARP; ++q) {
            const int pixel = (warp + q * WARPS) * 8 + (lane >> 2);
            const index_t ih = ih0 + pixel / HC, iw = iw0 + pixel % HC;
            const bool inside = pixel < WINDOW && ih >= 0 && ih < H && iw >= 0 && iw < W;
            const scalar_t* at = x + (static_cast<index_t>(n) * CIN + ic0 + (lane & 3)) * plane + ih * W + iw;
#pragma unroll
            for (int j = 0; j < ICC / 4; ++j) {
                const bool ok = inside && ic0 + (lane & 3) + 4 * j < CIN;
                window[q][j] = ok ? __ldg(at + 4 * j * plane) : 0.f;
            }
        }
#pragma unroll
        for (int i = 0; i < WEIGHT_LOADS; ++i) {
            const int e = threadIdx.x + i * THREADS;
            const int c = e % ICC, oc = (e / ICC) % COUT, tap = e / (ICC * COUT);
            const bool ok = tap < TAPS && ic0 + c < CIN;
            weight[i] = ok ? __ldg(w + weight_index(ic0 + c, oc, tap)) : 0.f;
        }
    }

    __device__ __forceinline__ void store(unsigned* stage) const {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        float* window_tile = reinterpret_cast<float*>(stage);
        float* weight_tile = reinterpret_cast<float*>(stage + WINDOW_WORDS);
#pragma unroll
        for (int q = 0; q < EIGHTS_A_WARP; ++q) {
            const int pixel = (warp + q * WARPS) * 8 + (lane >> 2);
            if (pixel < WINDOW) {
#pragma unroll
                for (int j = 0; j < ICC / 4; ++j)
                    window_tile[pixel * PITCH + (lane & 3) + 4 * j] = tf32_rounded(window[q][j]);
            }
        }
#pragma unroll
        for (int i = 0; i < WEIGHT_LOADS; ++i) {
            const int e = threadIdx.x + i * THREADS;
            const int c = e % ICC, oc = (e / ICC) % COUT, tap = e / (ICC * COUT);
            if (tap < TAPS) weight_tile[(tap * 8 + oc) * PITCH + c] = tf32_rounded(weight[i]);
        }
    }
};

extern "C" __global__ void __launch_bounds__(THREADS)
conv_transpose2d_forward_thin_mma(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                                  const scalar_t* __restrict__ bias, scalar_t* __restrict__ y, index_t H, index_t W,
                                  index_t H_out, index_t W_out, index_t tiles_w) {
    static_assert(sizeof(scalar_t) == 4, "float32 as TF32");
    extern __shared__ __align__(16) unsigned smem[];
    float* out_tile = reinterpret_cast<float*>(smem + 2 * STAGE_WORDS);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = blockIdx.y;
    const index_t tile_h = blockIdx.x / tiles_w, tile_w = blockIdx.x % tiles_w;
    const index_t ih0 = tile_h * PR + HR0, iw0 = tile_w * PC + HC0;

    // Output channels past COUT: zero weight rows in both stages, never written by a chunk.
    for (int e = threadIdx.x; e < 2 * TAPS * (8 - COUT) * ICC; e += THREADS) {
        const int c = e % ICC, row = e / ICC, stage = row / (TAPS * (8 - COUT)), r = row % (TAPS * (8 - COUT));
        reinterpret_cast<float*>(smem + stage * STAGE_WORDS + WINDOW_WORDS)[
            ((r / (8 - COUT)) * 8 + COUT + r % (8 - COUT)) * PITCH + c] = 0.f;
    }

    float acc[NPH][ROWS_A_WARP][4];
#pragma unroll
    for (int p = 0; p < NPH; ++p)
#pragma unroll
        for (int i = 0; i < ROWS_A_WARP; ++i)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[p][i][r] = 0.f;

    constexpr int CHUNKS = (CIN + ICC - 1) / ICC;
    ChunkLoads loads;
    loads.load(x, w, n, 0, ih0, iw0, H, W);
    loads.store(smem);
    __syncthreads();
    for (int chunk = 0; chunk < CHUNKS; ++chunk) {
        if (chunk + 1 < CHUNKS) loads.load(x, w, n, (chunk + 1) * ICC, ih0, iw0, H, W);
        const unsigned* window_tile = smem + (chunk % 2) * STAGE_WORDS;
        const unsigned* weight_tile = window_tile + WINDOW_WORDS;
        // (the two k8 steps one after the other: unrolled, ptxas held 236 registers, a block an SM fewer)
#pragma unroll 1
        for (int ks = 0; ks < ICC / KSTEP_WORDS; ++ks) {
#pragma unroll
            for (int a = 0; a < SH; ++a)
#pragma unroll
                for (int kh = 0; kh < KH; ++kh) {
                    if (!feeds(a, kh, PH, DH, SH)) continue;
                    const int row_offset = window_offset(a, kh, PH, DH, SH, HR0);
#pragma unroll
                    for (int b = 0; b < SW; ++b)
#pragma unroll
                        for (int kw = 0; kw < KW; ++kw) {
                            if (!feeds(b, kw, PW, DW, SW)) continue;
                            const int col_offset = window_offset(b, kw, PW, DW, SW, HC0);
                            unsigned bf[2];
                            ldmatrix_x2(bf, smem_addr(weight_tile + ((kh * KW + kw) * 8 + (lane & 7)) * PITCH +
                                                      ks * KSTEP_WORDS + ((lane >> 3) & 1) * 4));
#pragma unroll
                            for (int i = 0; i < ROWS_A_WARP; ++i) {
                                const int phase_row = warp + i * WARPS;
                                const int pixel = (phase_row + row_offset) * HC + (lane & 15) + col_offset;
                                unsigned af[4];
                                ldmatrix_x4(af, smem_addr(window_tile + pixel * PITCH + ks * KSTEP_WORDS +
                                                          (lane >> 4) * 4));
                                mma_16x8<MMA_TF32>(acc[a * SW + b][i], af, bf);
                            }
                        }
                }
        }
        if (chunk + 1 < CHUNKS) loads.store(smem + ((chunk + 1) % 2) * STAGE_WORDS);
        __syncthreads();
    }

    // Fragment (phase, i, r): phase row warp + i*WARPS, phase column lane/4 (+8 for r >= 2), output channel
    // 2*(lane%4) + r%2.
#pragma unroll
    for (int a = 0; a < SH; ++a)
#pragma unroll
        for (int b = 0; b < SW; ++b)
#pragma unroll
            for (int i = 0; i < ROWS_A_WARP; ++i)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int oc = 2 * (lane % 4) + r % 2;
                    const int row = a + SH * (warp + i * WARPS), col = b + SW * (lane / 4 + (r / 2) * 8);
                    if (oc < COUT) out_tile[(oc * TH + row) * TW + col] = acc[a * SW + b][i][r];
                }
    __syncthreads();
    const index_t oh0 = tile_h * TH, ow0 = tile_w * TW;
    for (int e = threadIdx.x; e < OUT_WORDS; e += THREADS) {
        const int oc = e / (TH * TW), row = (e / TW) % TH, col = e % TW;
        const index_t oh = oh0 + row, ow = ow0 + col;
        if (oh < H_out && ow < W_out) {
            float v = out_tile[e];
            if constexpr (HAS_BIAS) v += load(bias + oc);
            store(y + ((static_cast<index_t>(n) * COUT + oc) * H_out + oh) * W_out + ow, v);
        }
    }
}
