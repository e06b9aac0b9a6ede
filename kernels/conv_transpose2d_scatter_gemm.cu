// The forward of a transposed convolution in which every output pixel receives exactly one tap (kernel ==
// stride, as in U-Net's 2 x 2 stride-2 upsampling; a 1 x 1 input; 1 x 1 kernels), as one GEMM on Hopper's
// warpgroup MMA (wgmma, sm_90a):
//   Y[m][n] = sum_k X[m][k] * W[k][n],  m = input pixel (image, i, j), k = input channel,
//   n = (tap, output channel) in a channels_last weight's order (C_in, KH, KW, C_out),
// whose epilogue scatters row m, column n to output pixel (SH*i + kh - PH, SW*j + kw - PW), dropping the
// ones cropped away.  Nothing is gathered: A's rows are the input's channels_last pixels in memory order,
// read once for all taps, and B is the weight itself, an MN-major operand, both copied by the copy engine.  A
// contiguous weight is copied into the channels_last order first.
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

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "fp16 or bf16: B is MN-major, which TF32 cannot read");
static_assert(GROUPS == 1 && WEIGHT_CL, "one group; the weight in channels_last order");
static_assert(CIN % VEC == 0 && N_TOTAL % VEC == 0 && COUT % 2 == 0,
              "16-byte runs of input channels and of columns; output channel pairs within a tap");
static_assert(Gemm::A_BYTES % 1024 == 0 && Gemm::B_COLUMN_BLOCK % 1024 == 0 && Gemm::STAGE_BYTES % 1024 == 0,
              "boxes land 1024-byte aligned, as the copy engine's 128-byte swizzle needs");

// One producer thread copies a step as copy-engine (TMA) boxes: A, the tile's BM input pixels by CK channels
// (the channels_last input as [pixels][channels]); B, CK input channels of each of the tile's 64-column blocks
// of the weight.  Rows and columns past the tensors land as zeros.  With every thread copying 16-byte runs,
// the producer's issue rate held the gather GEMM, its transpose (NOTES v43).
struct ScatterProducer : CopyEngineProducer {
    const TensorMap* src_map;
    const TensorMap* weight_map;
    index_t m0;
    int n0;

    __device__ __forceinline__ void tile(index_t m, int n) { m0 = m; n0 = n; }

    __device__ __forceinline__ void step(unsigned a, unsigned b, int c, unsigned full) {
        if (threadIdx.x % 128 != 0) return;
        mbarrier_expect_bytes(full, Gemm::STAGE_BYTES);
        tensor_copy_4d(a, *src_map, c * CK, static_cast<int>(m0), 0, 0, full);   // pixels < 2^31 (the planner's)
#pragma unroll
        for (int j = 0; j < BN / 64; ++j)
            tensor_copy_4d(b + j * Gemm::B_COLUMN_BLOCK, *weight_map, n0 + 64 * j, c * CK, 0, 0, full);
    }
};

// Each column pair (jn, lane % 4) is one tap's two output channels; each row one input pixel.
struct ScatterStore {
    const scalar_t* __restrict__ bias;
    scalar_t* __restrict__ dst;
    index_t M, H_SRC, W_SRC, H_DST, W_DST;

    // An input pixel's row: its image's output, and where its tap (0, 0) lands
    struct Row {
        bool keep;
        scalar_t* out;
        index_t oh0, ow0;
    };

    __device__ __forceinline__ void operator()(float (&acc)[MB][BN / 2], index_t m0, int n0) const {
        const index_t dst_plane = H_DST * W_DST;
        Gemm::store_pairs(acc, [&](int r) {
            const index_t m = m0 + r;
            if (m >= M) return Row{false, dst, 0, 0};
            const index_t image = m / (H_SRC * W_SRC), at = m % (H_SRC * W_SRC);
            return Row{true, dst + image * dst_plane * COUT, SH * (at / W_SRC) - PH, SW * (at % W_SRC) - PW};
        }, [&](const Row& at, int n_in_tile, float v0, float v1) {
            const int n = n0 + n_in_tile;
            if (n >= N_TOTAL) return;
            const int tap = n / COUT, oc = n % COUT;
            const index_t oh = at.oh0 + tap / KW, ow = at.ow0 + tap % KW;
            if (oh < 0 || oh >= H_DST || ow < 0 || ow >= W_DST) return;
            if constexpr (HAS_BIAS) {
                v0 += load(bias + oc);
                v1 += load(bias + oc + 1);
            }
            const index_t pixel = oh * W_DST + ow;
            if constexpr (DST_CL) {
                store_pair(at.out + pixel * COUT + oc, v0, v1);   // channel pairs are whole words
            } else {
                store(at.out + oc * dst_plane + pixel, v0);
                store(at.out + (oc + 1) * dst_plane + pixel, v1);
            }
        });
    }
};

extern "C" __global__ void __launch_bounds__(Gemm::THREADS, 1)
conv_transpose2d_scatter_gemm(const scalar_t* __restrict__ src, const scalar_t* __restrict__ weight,
                              const scalar_t* __restrict__ bias, scalar_t* __restrict__ dst,
                              index_t N, index_t H_SRC, index_t W_SRC, index_t H_DST, index_t W_DST,
                              const __grid_constant__ TensorMap src_map, const __grid_constant__ TensorMap weight_map) {
    extern __shared__ __align__(1024) unsigned char smem[];   // STAGES x (A tile, then B tile)
    const index_t M = N * H_SRC * W_SRC;
    ScatterProducer producer{CopyEngineProducer{}, &src_map, &weight_map, 0, 0};
    ScatterStore store{bias, dst, M, H_SRC, W_SRC, H_DST, W_DST};
    Gemm::run(smem, (M + BM - 1) / BM * N_TILES, producer, store);
}
