// grad_weight of a transposed convolution on Hopper's warpgroup MMA (wgmma, sm_90a): a
// split-K GEMM per (group, tap), as conv_transpose2d_grad_weight_igemm.cu computes it on
// mma.sync, with M = input channels, N = output channels and K = every input pixel:
//   grad_weight[ic, oc, kh, kw] = sum over (n, i, j) of
//       x[n, i, j, ic] * grad_out[n, SH*i - PH + kh*DH, SW*j - PW + kw*DW, oc]
// Both sources are channels_last with whole 16-byte channel runs (NCHW ones are copied
// into that form first).  Each K tile of BK pixels lands by cp.async as [16-byte channel
// group][pixel][16 bytes], so eight consecutive pixels of one group are a core matrix
// whose rows run along K: x^T (A) and grad_out (B) are both MN-major operands, which
// wgmma reads through its transpose bits, with no shuffle in between.
// blockIdx.z picks a fixed range of K; each block writes its partial product (no atomics)
// and reduce_partials.cu adds the ranges in a fixed order, so the result is bitwise
// reproducible.  With a single range (SINGLE_CHUNK) it writes grad_weight itself.  The
// taps of one group run side by side (blockIdx.x is fastest), so they share the same
// stretch of x and grad_out through L2.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int WARPGROUPS = {{WARPGROUPS}};   // each owns 64 input channels of the tile
constexpr int BM = 64 * WARPGROUPS, BN = {{BN}}, BK = {{BK}};
constexpr int STAGES = {{STAGES}};
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
typedef PartialOut<SINGLE_CHUNK, scalar_t, float>::type partial_t;

constexpr int THREADS = 128 * WARPGROUPS;
constexpr int VEC = 8;   // 16-bit channels in one 16-byte run
constexpr int M_TILES = (CIN_G + BM - 1) / BM, N_TILES = (COUT_G + BN - 1) / BN;
// A channel group's plane holds BK pixels and one spare 16-byte slot, so that the copies of
// one pixel's eight groups (eight neighbouring threads) fall on different banks.
constexpr int GROUP_PLANE = (BK + 1) * 16;
constexpr int A_BYTES = BM / VEC * GROUP_PLANE, B_BYTES = BN / VEC * GROUP_PLANE;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int A_RUNS = BM / VEC, B_RUNS = BN / VEC;
constexpr int A_VECS = BK * A_RUNS / THREADS, B_VECS = BK * B_RUNS / THREADS;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "MN-major operands exist for 16-bit types only");
static_assert(CIN_G % VEC == 0 && COUT_G % VEC == 0, "channels in whole 16-byte runs");
static_assert(BK % 16 == 0 && A_VECS * THREADS == BK * A_RUNS && B_VECS * THREADS == BK * B_RUNS,
              "whole MMA steps per tile, and every thread copies whole vectors of each tile");
static_assert(STAGES >= 2, "a ring of at least two tiles");
static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
conv_transpose2d_grad_weight_wgmma(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                   partial_t* __restrict__ partial, index_t N, index_t H, index_t W,
                                   index_t H_out, index_t W_out, index_t k_tiles_per_split) {
    extern __shared__ __align__(128) unsigned char smem[];   // STAGES x (A tile, B tile)

    const int tid = threadIdx.x, wg = tid / 128, warp = tid % 128 / 32, lane = tid % 32;
    const int g = blockIdx.x / TAPS, t = blockIdx.x % TAPS;
    const int dh = (t / KW) * DH - PH, dw = (t % KW) * DW - PW;
    const int m0 = (blockIdx.y / N_TILES) * BM, n0 = (blockIdx.y % N_TILES) * BN;
    const index_t plane = H * W;
    const index_t K = N * plane;
    const index_t k_tiles_total = (K + BK - 1) / BK;
    const index_t kt0 = static_cast<index_t>(blockIdx.z) * k_tiles_per_split;
    const index_t kt1 = kt0 + k_tiles_per_split < k_tiles_total ? kt0 + k_tiles_per_split : k_tiles_total;
    const int k_tiles = kt1 > kt0 ? static_cast<int>(kt1 - kt0) : 0;
    const scalar_t* x_group = x + g * CIN_G + m0;
    const scalar_t* go_group = grad_out + g * COUT_G + n0;

    // Each thread copies the same pixel rows and channel runs of every tile.
    auto issue = [&](int kt, int s) {
        unsigned char* a_tile = smem + s * STAGE_BYTES;
        unsigned char* b_tile = a_tile + A_BYTES;
        const index_t p0 = (kt0 + kt) * BK;
#pragma unroll
        for (int q = 0; q < A_VECS; ++q) {
            const int v = tid + q * THREADS, row = v / A_RUNS, c = v % A_RUNS;
            const index_t p = p0 + row;
            const bool ok = p < K && m0 + c * VEC < CIN_G;
            cp_async_16(smem_addr(a_tile + c * GROUP_PLANE + row * 16), ok ? x_group + p * CIN + c * VEC : x, ok);
        }
#pragma unroll
        for (int q = 0; q < B_VECS; ++q) {
            const int v = tid + q * THREADS, row = v / B_RUNS, c = v % B_RUNS;
            const index_t p = p0 + row;
            const index_t n = p / plane, rem = p - n * plane;
            const index_t i = rem / W, j = rem - i * W;
            const index_t oh = static_cast<index_t>(SH) * i + dh, ow = static_cast<index_t>(SW) * j + dw;
            const bool ok = p < K && n0 + c * VEC < COUT_G && oh >= 0 && oh < H_out && ow >= 0 && ow < W_out;
            cp_async_16(smem_addr(b_tile + c * GROUP_PLANE + row * 16),
                        ok ? go_group + ((n * H_out + oh) * W_out + ow) * COUT + c * VEC : grad_out, ok);
        }
    };

    float acc[BN / 2];
#pragma unroll
    for (int e = 0; e < BN / 2; ++e) acc[e] = 0.0f;

    // The ring of cp_async_pipeline, with the fence that hands cp.async's writes to the
    // tensor cores' async proxy before the barrier.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) issue(s, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        fence_async_shared();
        // Tile kt has landed for every thread, and the MMAs that read the buffer the next
        // issue overwrites (tile kt - 1) have completed.
        __syncthreads();
        const int next = kt + STAGES - 1;
        if (next < k_tiles) issue(next, next % STAGES);
        cp_async_commit();
        const unsigned a_base = smem_addr(smem + (kt % STAGES) * STAGE_BYTES) + wg * (64 / VEC) * GROUP_PLANE;
        const unsigned b_base = smem_addr(smem + (kt % STAGES) * STAGE_BYTES + A_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            // 16 pixels: two core matrices along K, 128 bytes apart; channel groups a plane apart.
            const unsigned long long a = smem_descriptor(a_base + kk * 256, 128, GROUP_PLANE);
            const unsigned long long b = smem_descriptor(b_base + kk * 256, 128, GROUP_PLANE);
            wgmma_async<KIND, BN, 1>(acc, a, b, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_registers(acc);
    }
    cp_async_wait<0>();

    // partial[split][g*CIN_G + ic][oc][t]: the weight's own layout, one copy per split
    partial_t* out = partial + static_cast<index_t>(blockIdx.z) * CIN * COUT_G * TAPS
                     + static_cast<index_t>(g) * CIN_G * COUT_G * TAPS + t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int ic = m0 + wg * 64 + warp * 16 + lane / 4 + h * 8;
        if (ic >= CIN_G) continue;
#pragma unroll
        for (int jn = 0; jn < BN / 8; ++jn)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int oc = n0 + jn * 8 + (lane % 4) * 2 + q;
                if (oc < COUT_G) store(out + (static_cast<index_t>(ic) * COUT_G + oc) * TAPS, acc[jn * 4 + h * 2 + q]);
            }
    }
}
