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
// The block is persistent over tiles of BM pixels x BN columns (the N tiles of one pixel tile adjacent, so
// its pixels come from L2).  The last warpgroup produces: for each CK-channel step of a tile it cp.asyncs the
// A rows and the B rows into a ring of STAGES buffers, as 128-byte swizzled rows, and arrives on the step's
// "full" barrier.  Two consumer warpgroups take the tiles in turn (ping-pong), each a whole BM x BN tile in
// its accumulators: while one stores its tile straight from the registers, the other's MMAs run, and with
// few K steps a tile (a layer's input channels) the stores are a large share of the time.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"
#include "mbarrier_copy.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int MB = {{MB}};            // 64-row MMA blocks per tile: BM = 64 * MB pixels
constexpr int BN = {{BN}};            // columns of (tap, output channel) per tile
constexpr int STAGES = {{STAGES}};
constexpr bool DST_CL = {{DST_CL}};
constexpr bool HAS_BIAS = {{HAS_BIAS}};

constexpr int CONSUMERS = 2;
constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int BM = 64 * MB;
constexpr int VEC = 16 / sizeof(scalar_t);     // channels in 16 bytes
constexpr int K_STEP = 32 / sizeof(scalar_t);  // channels one wgmma consumes
constexpr int CK = 128 / sizeof(scalar_t);     // channels of a step: one 128-byte swizzled row
constexpr int K_STEPS = (CIN + CK - 1) / CK;
constexpr int N_TOTAL = TAPS * COUT;
constexpr int N_TILES = (N_TOTAL + BN - 1) / BN;
constexpr int A_BYTES = BM * 128;              // BM rows (pixels) of CK channels
constexpr int B_COLUMN_BLOCK = CK * 128;       // CK rows (input channels) of 64 columns
constexpr int B_BYTES = BN / 64 * B_COLUMN_BLOCK;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int A_COPIES = BM * 8 / 128;         // a producer thread's 16-byte copies of A per step
constexpr int B_ROW_VECS = BN / VEC;           // 16-byte vectors along one B row
constexpr int B_ROW_STEP = 128 / B_ROW_VECS;   // B rows from one of a thread's copies to the next
constexpr int B_COPIES = CK / B_ROW_STEP;
constexpr int PRODUCER_REGISTERS = 56, CONSUMER_REGISTERS = 224;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "fp16 or bf16: B is MN-major, which TF32 cannot read");
static_assert(GROUPS == 1 && WEIGHT_CL, "one group; the weight in channels_last order");
static_assert(CIN % VEC == 0 && N_TOTAL % VEC == 0 && COUT % 2 == 0,
              "16-byte runs of input channels and of columns; output channel pairs within a tap");
static_assert(BN % 64 == 0 && BN <= 256 && 128 % B_ROW_VECS == 0 && MB >= 1 && MB * BN <= 256,
              "whole 64-column blocks; a thread's B copies at one place along the rows; accumulators fit");
static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
conv_transpose2d_scatter_gemm(const scalar_t* __restrict__ src, const scalar_t* __restrict__ weight,
                              const scalar_t* __restrict__ bias, scalar_t* __restrict__ dst,
                              index_t N, index_t H_SRC, index_t W_SRC, index_t H_DST, index_t W_DST) {
    extern __shared__ __align__(1024) unsigned char smem[];   // STAGES x (A tile, then B tile)
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    // turn[w]: the other consumer has waited on its previous tile's last step (below).
    __shared__ __align__(8) unsigned long long turn[CONSUMERS];

    const int tid = threadIdx.x;
    const index_t M = N * H_SRC * W_SRC;
    const index_t tile_count = (M + BM - 1) / BM * N_TILES;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(smem_addr(&full[s]), 128);   // every producer thread's copies
            mbarrier_init(smem_addr(&empty[s]), 1);    // the consuming warpgroup
        }
        for (int w = 0; w < CONSUMERS; ++w) mbarrier_init(smem_addr(&turn[w]), 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    const unsigned smem_base = smem_addr(smem);
    auto a_slot = [&](int s) { return smem_base + (s % STAGES) * STAGE_BYTES; };
    const int warpgroup = tid / 128;

    if (warpgroup == CONSUMERS) {
        // ------------------------------------------------------------------ producer
        registers_release<PRODUCER_REGISTERS>();
        const int ptid = tid % 128;
        // A: thread ptid copies vector ptid % 8 of rows ptid / 8 + 16 q.  B: vector ptid % B_ROW_VECS of rows
        // ptid / B_ROW_VECS + B_ROW_STEP q.
        const int a_vec = ptid % 8, a_row0 = ptid / 8;
        const int b_along = ptid % B_ROW_VECS * VEC, b_row0 = ptid / B_ROW_VECS;
        int s_iter = 0;
        for (index_t tile = blockIdx.x; tile < tile_count; tile += gridDim.x) {
            const index_t m0 = tile / N_TILES * BM;
            const int n0 = static_cast<int>(tile % N_TILES) * BN;
            for (int c = 0; c < K_STEPS; ++c, ++s_iter) {
                mbarrier_wait(smem_addr(&empty[s_iter % STAGES]), ((s_iter / STAGES) & 1) ^ 1);
                const unsigned a = a_slot(s_iter), b = a + A_BYTES;
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
                    const unsigned at = b + b_along / 64 * B_COLUMN_BLOCK + r * 128 + b_along % 64 * 2;
                    cp_async_16(swizzle_128b(at), ok ? weight + static_cast<index_t>(ic) * N_TOTAL + n : weight, ok);
                }
                cp_async_arrive(smem_addr(&full[s_iter % STAGES]));
            }
        }
        cp_async_wait<0>();
        return;
    }

    // ---------------------------------------------------------------------- consumers
    registers_claim<CONSUMER_REGISTERS>();
    const bool signals = tid % 128 == 0;   // one arrival per warpgroup on the "empty" barriers
    const int lane = tid % 32, warp = tid % 128 / 32;
    float acc[MB][BN / 2];
    // This warpgroup's tiles are every other one of the block's, and their steps every other run of K_STEPS.
    // A full barrier's parity tells its phases apart only while its waiter is at most one phase behind, so a
    // warpgroup starts a tile only once the other has waited on the previous tile's last step: the producer has
    // then filled every step up to there, and this tile's first step is at most one ring ahead of it.
    int s_iter = warpgroup * K_STEPS, turns = 0;
    for (index_t tile = blockIdx.x + warpgroup * gridDim.x; tile < tile_count;
         tile += CONSUMERS * gridDim.x, s_iter += CONSUMERS * K_STEPS, ++turns) {
        if (warpgroup == 1 || turns > 0) {
            const int waited = warpgroup == 1 ? turns : turns - 1;   // the other's tiles this one follows
            mbarrier_wait(smem_addr(&turn[warpgroup]), waited & 1);
        }
        const index_t m0 = tile / N_TILES * BM;
        const int n0 = static_cast<int>(tile % N_TILES) * BN;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[mb][i] = 0.f;
        int pending = -1;   // the step whose MMAs may still run
        for (int c = 0; c < K_STEPS; ++c) {
            const int s = s_iter + c;
            mbarrier_wait(smem_addr(&full[s % STAGES]), (s / STAGES) & 1);
            if (signals && c == K_STEPS - 1) mbarrier_arrive(smem_addr(&turn[1 - warpgroup]));
            fence_async_shared();   // the copies came through cp.async (the generic proxy); wgmma reads async
            const unsigned a = a_slot(s), b = a + A_BYTES;
#pragma unroll
            for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < CK / K_STEP; ++kk) {
                // B: 16 rows (two groups of eight) of the MN-major column blocks; A: 32 bytes into its rows.
                const unsigned long long b_desc = smem_descriptor_swizzle_128b(b + kk * 2048, B_COLUMN_BLOCK, 1024);
#pragma unroll
                for (int mb = 0; mb < MB; ++mb)
                    wgmma_async<KIND, BN, 0, 1>(acc[mb],
                                                smem_descriptor_swizzle_128b(a + mb * 64 * 128 + kk * 32, 16, 1024),
                                                b_desc, 1);
            }
            wgmma_commit();
#pragma unroll
            for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
            wgmma_wait<1>();   // the previous step's MMAs are done: release its buffer
            if (signals && pending >= 0) mbarrier_arrive(smem_addr(&empty[pending]));
            pending = s % STAGES;
        }
        wgmma_wait<0>();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
        if (signals && pending >= 0) mbarrier_arrive(smem_addr(&empty[pending]));

        // Each column pair (jn, lane % 4) is one tap's two output channels; each row one input pixel.
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
}
