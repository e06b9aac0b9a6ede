// The forward of a transposed convolution in which every output pixel receives exactly one tap (kernel ==
// stride, as in U-Net's 2 x 2 stride-2 upsampling; a 1 x 1 input; 1 x 1 kernels), as one GEMM on Hopper's
// warpgroup MMA (wgmma, sm_90a):
//   Y[m][n] = sum_k X[m][k] * W[k][n],  m = input pixel (image, i, j), k = input channel,
//   n = (tap, output channel) in a channels_last weight's order (C_in, KH, KW, C_out),
// whose epilogue scatters row m, column n to output pixel (SH*i + kh - PH, SW*j + kw - PW), dropping the
// ones cropped away.  Nothing is gathered: A's rows are the input's channels_last pixels in memory order,
// read once for all taps, and B is the weight itself, an MN-major operand.  A contiguous weight is copied
// into the channels_last order first.
//
// The block is pingpong_gemm.cuh's: persistent over tiles of BM pixels x BN columns, a producer warpgroup
// filling a ring of CK-channel steps and two consumer warpgroups taking the tiles in turn.  With few K steps a
// tile (a layer's input channels) the scattering stores are a large share of the time, and one consumer's
// stores overlap the other's MMAs.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"
#include "mbarrier_copy.cuh"
#include "pingpong_gemm.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int MB = {{MB}};            // 64-row MMA blocks per tile: BM = 64 * MB pixels
constexpr int BN = {{BN}};            // columns of (tap, output channel) per tile
constexpr int STAGES = {{STAGES}};
constexpr bool DST_CL = {{DST_CL}};
constexpr bool HAS_BIAS = {{HAS_BIAS}};

constexpr int VEC = 16 / sizeof(scalar_t);     // channels in 16 bytes
constexpr int CK = 128 / sizeof(scalar_t);     // channels of a step: one 128-byte swizzled row
constexpr int K_STEPS = (CIN + CK - 1) / CK;
constexpr int N_TOTAL = TAPS * COUT;
constexpr int N_TILES = (N_TOTAL + BN - 1) / BN;
typedef PingPongGemm<KIND, MB, BN, STAGES, K_STEPS, N_TILES, true> Gemm;
constexpr int BM = Gemm::BM;
constexpr int A_COPIES = BM * 8 / 128;         // a producer thread's 16-byte copies of A per step
constexpr int B_ROW_VECS = BN / VEC;           // 16-byte vectors along one B row
constexpr int B_ROW_STEP = 128 / B_ROW_VECS;   // B rows from one of a thread's copies to the next
constexpr int B_COPIES = CK / B_ROW_STEP;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "fp16 or bf16: B is MN-major, which TF32 cannot read");
static_assert(GROUPS == 1 && WEIGHT_CL, "one group; the weight in channels_last order");
static_assert(CIN % VEC == 0 && N_TOTAL % VEC == 0 && COUT % 2 == 0,
              "16-byte runs of input channels and of columns; output channel pairs within a tap");
static_assert(128 % B_ROW_VECS == 0, "a thread's B copies at one place along the rows");

// A: thread ptid copies vector ptid % 8 of rows ptid / 8 + 16 q (input pixels in memory order).  B: vector
// ptid % B_ROW_VECS of rows ptid / B_ROW_VECS + B_ROW_STEP q (input channels of the weight's columns).
struct ScatterProducer {
    static constexpr int FULL_ARRIVALS = 128;   // each thread's cp.asyncs
    const scalar_t* __restrict__ src;
    const scalar_t* __restrict__ weight;
    index_t M;
    int a_vec, a_row0, b_along, b_row0;
    index_t m0;
    int n0;

    __device__ __forceinline__ void tile(index_t m, int n) { m0 = m; n0 = n; }

    __device__ __forceinline__ void step(unsigned a, unsigned b, int c, unsigned /* full */) {
        const int k = c * CK + a_vec * VEC;
#pragma unroll 1
        for (int q = 0; q < A_COPIES; ++q) {
            const int r = a_row0 + 16 * q;
            const bool ok = m0 + r < M && k < CIN;
            cp_async_16(swizzle_128b(a + r * 128 + a_vec * 16), ok ? src + (m0 + r) * CIN + k : src, ok);
        }
        const int n = n0 + b_along;
#pragma unroll 1
        for (int q = 0; q < B_COPIES; ++q) {
            const int r = b_row0 + B_ROW_STEP * q, ic = c * CK + r;
            const bool ok = ic < CIN && n < N_TOTAL;
            const unsigned at = b + b_along / 64 * Gemm::B_COLUMN_BLOCK + r * 128 + b_along % 64 * 2;
            cp_async_16(swizzle_128b(at), ok ? weight + static_cast<index_t>(ic) * N_TOTAL + n : weight, ok);
        }
    }
};

// Each column pair (jn, lane % 4) is one tap's two output channels; each row one input pixel.
struct ScatterStore {
    const scalar_t* __restrict__ bias;
    scalar_t* __restrict__ dst;
    index_t M, H_SRC, W_SRC, H_DST, W_DST;

    __device__ __forceinline__ void operator()(float (&acc)[MB][BN / 2], index_t m0, int n0) const {
        const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32;
        const index_t dst_plane = H_DST * W_DST;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const index_t m = m0 + mb * 64 + warp * 16 + lane / 4 + h * 8;
                if (m >= M) continue;
                const index_t image = m / (H_SRC * W_SRC), at = m % (H_SRC * W_SRC);
                const index_t oh0 = SH * (at / W_SRC) - PH, ow0 = SW * (at % W_SRC) - PW;
                scalar_t* out = dst + image * dst_plane * COUT;
#pragma unroll
                for (int jn = 0; jn < BN / 8; ++jn) {
                    const int n = n0 + jn * 8 + (lane % 4) * 2;
                    if (n >= N_TOTAL) continue;
                    const int tap = n / COUT, oc = n % COUT;
                    const index_t oh = oh0 + tap / KW, ow = ow0 + tap % KW;
                    if (oh < 0 || oh >= H_DST || ow < 0 || ow >= W_DST) continue;
                    float v0 = acc[mb][jn * 4 + h * 2], v1 = acc[mb][jn * 4 + h * 2 + 1];
                    if constexpr (HAS_BIAS) {
                        v0 += load(bias + oc);
                        v1 += load(bias + oc + 1);
                    }
                    const index_t pixel = oh * W_DST + ow;
                    if constexpr (DST_CL) {
                        store_pair(out + pixel * COUT + oc, v0, v1);   // channel pairs are whole words
                    } else {
                        store(out + oc * dst_plane + pixel, v0);
                        store(out + (oc + 1) * dst_plane + pixel, v1);
                    }
                }
            }
        }
    }
};

extern "C" __global__ void __launch_bounds__(Gemm::THREADS, 1)
conv_transpose2d_scatter_gemm(const scalar_t* __restrict__ src, const scalar_t* __restrict__ weight,
                              const scalar_t* __restrict__ bias, scalar_t* __restrict__ dst,
                              index_t N, index_t H_SRC, index_t W_SRC, index_t H_DST, index_t W_DST) {
    extern __shared__ __align__(1024) unsigned char smem[];   // STAGES x (A tile, then B tile)
    const index_t M = N * H_SRC * W_SRC;
    const int ptid = threadIdx.x % 128;
    ScatterProducer producer{src, weight, M, ptid % 8, ptid / 8, ptid % B_ROW_VECS * VEC, ptid / B_ROW_VECS, 0, 0};
    ScatterStore store{bias, dst, M, H_SRC, W_SRC, H_DST, W_DST};
    Gemm::run(smem, (M + BM - 1) / BM * N_TILES, producer, store);
}
