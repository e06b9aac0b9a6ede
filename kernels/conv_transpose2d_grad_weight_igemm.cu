// grad_weight of a transposed convolution as a split-K tensor-core implicit GEMM.
//
// For each group and tap (blockIdx.x) it is a GEMM with M = input channels of the
// group, N = output channels of the group and K = every input pixel:
//   grad_weight[ic, oc, kh, kw] = sum over (n, i, j) of
//       x[n, ic, i, j] * grad_out[n, oc, SH*i - PH + kh*DH, SW*j - PW + kw*DW]
// blockIdx.z picks a fixed range of K; each block writes its partial product (no
// atomics) and reduce_partials.cu adds the ranges in a fixed order, so the result
// is bitwise reproducible.  With a single range (SINGLE_CHUNK) it writes grad_weight itself.  The taps of one group run side by side (blockIdx.x is
// fastest), so they share the same stretch of x and grad_out through L2.
//
// VEC (16-bit types, channels_last, whole 16-byte channel runs): each K row of a
// tile is a run of channels of one pixel, so tiles are cp.async copies into a
// STAGES-deep ring of [K][channels] buffers, read with ldmatrix.trans.  Otherwise
// the pixels of the next K tile are decoded into a small shared table one tile
// ahead and the elements are gathered through registers.
#include "layer.cuh"
#include "mma.cuh"
#include "gemm_tile.cuh"
#include "cp_async_pipeline.cuh"

constexpr bool CHANNELS_LAST = {{CHANNELS_LAST}};
constexpr bool VEC = {{VEC}};
constexpr int STAGES = {{STAGES}};
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
typedef PartialOut<SINGLE_CHUNK, scalar_t, float>::type partial_t;
constexpr bool A_L1 = {{A_L1}};       // activation copies through L1 (see cp_async_16_l1)

constexpr int M_TILES = (CIN_G + BM - 1) / BM;
constexpr int N_TILES = (COUT_G + BN - 1) / BN;
// NCHW: pixels (K) are adjacent, so threads run along K; channels_last: along channels.
constexpr bool ROWS_FASTEST = CHANNELS_LAST;
constexpr int A_WORDS = BM * TILE_K_WORDS / THREADS;
constexpr int B_WORDS = BN * TILE_K_WORDS / THREADS;

static_assert(A_WORDS >= 1 && B_WORDS >= 1, "every thread loads at least one word of each tile");

// VEC: [BK][BM] and [BK][BN] 16-bit tiles; a pitch of 4 (mod 16) words keeps ldmatrix conflict-free.
constexpr int A_PITCH = BM / 2 + 4, B_PITCH = BN / 2 + 4;
constexpr int A_VECS = BK * BM / 8 / THREADS, B_VECS = BK * BN / 8 / THREADS;
constexpr int VEC_STAGE_WORDS = BK * (A_PITCH + B_PITCH);
static_assert(!VEC || (sizeof(scalar_t) == 2 && CHANNELS_LAST && CIN_G % 8 == 0 && COUT_G % 8 == 0),
              "vector tiles need 16-bit channels_last data in whole 16-byte runs");
static_assert(!VEC || (A_VECS * THREADS == BK * BM / 8 && B_VECS * THREADS == BK * BN / 8 && A_VECS >= 1),
              "every thread copies whole vectors of each tile");
static_assert(VEC ? STAGES >= 2 : STAGES == 2, "the register-staged path double-buffers");
constexpr int STAGE_WORDS = VEC ? VEC_STAGE_WORDS : (BM + BN) * ROW_WORDS;

template <int ROWS>
using Map = TileMap<ROWS, ROWS_FASTEST, THREADS>;

struct Pixel { int n, i, j; };

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
conv_transpose2d_grad_weight_igemm(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                   partial_t* __restrict__ partial, index_t N, index_t H, index_t W,
                                   index_t H_out, index_t W_out, index_t k_tiles_per_split) {
    extern __shared__ __align__(16) unsigned stage_smem[];  // STAGES x (A tile, B tile)
    __shared__ Pixel pixels[2][BK];
    auto a_tile = [&](int s) { return stage_smem + s * STAGE_WORDS; };
    auto b_tile = [&](int s) { return stage_smem + s * STAGE_WORDS + (VEC ? BK * A_PITCH : BM * ROW_WORDS); };

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = blockIdx.x / TAPS, t = blockIdx.x % TAPS;
    const int dh = (t / KW) * DH - PH, dw = (t % KW) * DW - PW;
    const int m0 = (blockIdx.y / N_TILES) * BM, n0 = (blockIdx.y % N_TILES) * BN;
    const index_t plane = H * W, plane_out = H_out * W_out;
    const index_t K = N * plane;
    const index_t k_tiles_total = (K + BK - 1) / BK;
    const index_t kt0 = static_cast<index_t>(blockIdx.z) * k_tiles_per_split;
    const index_t kt1 = kt0 + k_tiles_per_split < k_tiles_total ? kt0 + k_tiles_per_split : k_tiles_total;
    const int k_tiles = kt1 > kt0 ? static_cast<int>(kt1 - kt0) : 0;

    auto decode = [&](int slot, int kt) {
        for (int e = tid; e < BK; e += THREADS) {
            const index_t p = (kt0 + kt) * BK + e;
            Pixel px{-1, 0, 0};
            if (p < K) {
                const index_t rem = p % plane;
                px = Pixel{static_cast<int>(p / plane), static_cast<int>(rem / W), static_cast<int>(rem % W)};
            }
            pixels[slot][e] = px;
        }
    };

    const index_t c_stride = CHANNELS_LAST ? 1 : plane;
    const index_t c_stride_out = CHANNELS_LAST ? 1 : plane_out;
    const scalar_t* x_group = x + static_cast<index_t>(g * CIN_G + m0) * c_stride;
    const scalar_t* go_group = grad_out + static_cast<index_t>(g * COUT_G + n0) * c_stride_out;

    float acc[MI][NI][4], total[MI][NI][4];
    zero(acc);
    zero(total);

    const int warp_row = (warp / WARPS_N) * WM, warp_col = (warp % WARPS_N) * WN;

    if constexpr (VEC) {
        // Each thread copies the same K rows and channel runs of every tile.
        constexpr int A_RUNS = BM / 8, B_RUNS = BN / 8;
        auto issue = [&](int kt, int s) {
            const index_t p0 = (kt0 + kt) * BK;
#pragma unroll
            for (int q = 0; q < A_VECS; ++q) {
                const int v = tid + q * THREADS, row = v / A_RUNS, c = (v % A_RUNS) * 8;
                const index_t p = p0 + row;
                const bool ok = p < K && m0 + c < CIN_G;
                cp_async_16_via<A_L1>(smem_addr(a_tile(s) + row * A_PITCH + c / 2), ok ? x_group + p * CIN + c : x, ok);
            }
#pragma unroll
            for (int q = 0; q < B_VECS; ++q) {
                const int v = tid + q * THREADS, row = v / B_RUNS, c = (v % B_RUNS) * 8;
                const index_t p = p0 + row;
                const index_t n = p / plane, rem = p - n * plane;
                const index_t i = rem / W, j = rem - i * W;
                const index_t oh = static_cast<index_t>(SH) * i + dh, ow = static_cast<index_t>(SW) * j + dw;
                const bool ok = p < K && n0 + c < COUT_G && oh >= 0 && oh < H_out && ow >= 0 && ow < W_out;
                cp_async_16_via<A_L1>(smem_addr(b_tile(s) + row * B_PITCH + c / 2),
                            ok ? go_group + ((n * H_out + oh) * W_out + ow) * COUT + c : grad_out, ok);
            }
        };
        cp_async_pipeline<STAGES>(k_tiles, issue, [&](int cur) {
            // VEC holds here; testing it again keeps the K-major mma (no TF32 form) from being instantiated
            // for the register-staged path's kinds, since a lambda's body is compiled even in a discarded branch.
            if constexpr (VEC)
                warp_tile_mma_kmajor<KIND, MI, NI, A_PITCH, B_PITCH, BK / 16>(acc, a_tile(cur), b_tile(cur), warp_row,
                                                                              warp_col, lane);
        });
    } else {
        unsigned a_regs[A_WORDS], b_regs[B_WORDS];
        auto load_tiles = [&](int slot) {
#pragma unroll
            for (int q = 0; q < A_WORDS; ++q) {
                const int r = Map<BM>::row(tid, q);
                const int kk = Map<BM>::word(tid, q) * PER_WORD;
                unsigned word = 0;
#pragma unroll
                for (int e = 0; e < PER_WORD; ++e) {
                    const Pixel px = pixels[slot][kk + e];
                    const index_t pixel = static_cast<index_t>(px.i) * W + px.j;
                    const scalar_t* p = x_group + px.n * plane * CIN + (CHANNELS_LAST ? pixel * CIN : pixel) + r * c_stride;
                    word |= raw_bits(p, px.n >= 0 && m0 + r < CIN_G) << (16 * e);
                }
                a_regs[q] = word;
            }
#pragma unroll
            for (int q = 0; q < B_WORDS; ++q) {
                const int r = Map<BN>::row(tid, q);
                const int kk = Map<BN>::word(tid, q) * PER_WORD;
                unsigned word = 0;
#pragma unroll
                for (int e = 0; e < PER_WORD; ++e) {
                    const Pixel px = pixels[slot][kk + e];
                    const index_t oh = static_cast<index_t>(SH) * px.i + dh;
                    const index_t ow = static_cast<index_t>(SW) * px.j + dw;
                    const bool ok = px.n >= 0 && n0 + r < COUT_G && oh >= 0 && oh < H_out && ow >= 0 && ow < W_out;
                    const index_t pixel = oh * W_out + ow;
                    const scalar_t* p = go_group + px.n * plane_out * COUT + (CHANNELS_LAST ? pixel * COUT : pixel)
                                        + r * c_stride_out;
                    word |= raw_bits(p, ok) << (16 * e);
                }
                b_regs[q] = word;
            }
        };

        if (k_tiles > 0) {
            decode(0, 0);
            __syncthreads();
            load_tiles(0);
            Map<BM>::store(a_tile(0), tid, a_regs);
            Map<BN>::store(b_tile(0), tid, b_regs);
            if (k_tiles > 1) decode(1, 1);
            __syncthreads();
        }
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int cur = kt & 1;
            if (kt + 1 < k_tiles) load_tiles(cur ^ 1);
            warp_tile_mma<KIND, MI, NI>(acc, a_tile(cur), b_tile(cur), warp_row, warp_col, lane);
            if constexpr (KIND == MMA_3XTF32) promote(total, acc);
            if (kt + 1 < k_tiles) {
                Map<BM>::store(a_tile(cur ^ 1), tid, a_regs);
                Map<BN>::store(b_tile(cur ^ 1), tid, b_regs);
            }
            if (kt + 2 < k_tiles) decode(cur, kt + 2);
            __syncthreads();
        }
    }

    // partial[split] in the weight's own layout, one copy per split
    partial_t* out = partial + static_cast<index_t>(blockIdx.z) * CIN * COUT_G * TAPS;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int ic = m0 + warp_row + mi * 16 + (lane >> 2) + h * 8;
            if (ic >= CIN_G) continue;
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int oc = n0 + warp_col + ni * 8 + (lane & 3) * 2 + q;
                    if (oc < COUT_G)
                        store(out + weight_index(static_cast<index_t>(g) * CIN_G + ic, oc, t),
                              pick_result<KIND>(acc, total)[mi][ni][h * 2 + q]);
                }
        }
}
