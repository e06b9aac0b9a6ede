// grad_weight of a transposed convolution on Hopper's warpgroup MMA (wgmma, sm_90a): per
// group, a split-K GEMM with M = input channels, N = output channels and K = every input
// pixel, for a few taps at once:
//   grad_weight[ic, oc, kh, kw] = sum over (n, i, j) of
//       x[n, i, j, ic] * grad_out[n, SH*i - PH + kh*DH, SW*j - PW + kw*DW, oc]
// Tap (kh, kw) reads grad_out row SH*(i + ah) + rh, where rh = (kh*DH - PH) mod SH is its
// row phase and ah its shift; columns likewise.  A block takes up to TAP_GROUP taps of one
// phase (rh, rw), so for a K tile of TILE_H x TILE_W input pixels it needs the x tile and one
// "halo" of the phase's grad_out pixels, (TILE_H + SPAN_H) x (TILE_W + SPAN_W), and each tap
// is that halo read from a moved origin.  Both land by cp.async as rows of 128 bytes, a pixel's 64
// channels of one 64-channel block, in the 128-byte swizzle (wgmma.cuh): so x^T (A) and grad_out (B) are
// MN-major operands, read with wgmma's transpose bits, a pixel's channel run lands as one row (its copies
// coalesce), and a tap's origin may be any row of the halo.  A K tile is 8 x 8 pixels (or 16 x 8), its groups
// of eight pixels a row apart, or, for an input of few rows (a 1-D layer's one), 1 x 64.
// Both sources are channels_last with whole 16-byte channel runs (NCHW ones are copied into
// that form first).
// blockIdx.z picks a fixed range of K tiles; each block writes its partial products (no
// atomics) tap-major, partial[range][tap][ic][oc], so that a warp's stores fill whole sectors
// (in the weight's own layout a block's four taps leave every 4-byte store its own sector).
// reduce_tap_major_partials.cu adds the ranges in a fixed order, so the result is bitwise
// reproducible, and moves the taps last.  A channels_last weight's layout, [ic][tap][oc], serves
// as well as tap-major, so its partials are written in it and reduce_partials.cu adds them.
// A single range (SINGLE_CHUNK) of a one-tap layer or a channels_last weight, whose partials
// are the weight's layout, writes grad_weight itself.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"
#include "grad_weight_phase_taps.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int WARPGROUPS = {{WARPGROUPS}};   // each owns 64 input channels of the tile
constexpr int BM = 64 * WARPGROUPS, BN = {{BN}};
constexpr int TAP_GROUP = {{TAP_GROUP}};     // taps a block accumulates side by side
constexpr int TILE_H = {{TILE_H}}, TILE_W = {{TILE_W}};
constexpr int SPAN_H = {{SPAN_H}}, SPAN_W = {{SPAN_W}};   // the widest spread of one phase's tap shifts
constexpr int STAGES = {{STAGES}};
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
typedef PartialOut<SINGLE_CHUNK, scalar_t, float>::type partial_t;

constexpr int THREADS = 128 * WARPGROUPS;
constexpr int VEC = 8;   // 16-bit channels in one 16-byte run
constexpr int PHASES = SH * SW;
constexpr int TAP_CHUNKS = {{TAP_CHUNKS}};   // tap groups of the phase with the most taps
// Whether a block tests each tap of its group (some blocks have fewer) or runs the full group (plans.wgmma)
constexpr bool SKIP_ABSENT_TAPS = {{SKIP_ABSENT_TAPS}};
constexpr int M_TILES = (CIN_G + BM - 1) / BM, N_TILES = (COUT_G + BN - 1) / BN;
constexpr int TILE_PIXELS = TILE_H * TILE_W;
constexpr int HALO_H = TILE_H + SPAN_H, HALO_W = TILE_W + SPAN_W, HALO_PIXELS = HALO_H * HALO_W;
// A stage holds the x tile and the halo as blocks of 64 channels, each a row of 128 bytes per pixel; the
// warpgroups read the x tile's blocks, one each, and every MMA reads all of the halo's (BN / 64).
constexpr int ROW = 128, A_BLOCK = TILE_PIXELS * ROW, B_BLOCK = HALO_PIXELS * ROW;
constexpr int A_BYTES = WARPGROUPS * A_BLOCK, B_BYTES = (BN / 64) * B_BLOCK;
// Stages start on whole swizzle periods (1024 bytes: eight rows), so a row's swizzle is its offset's.
constexpr int SWIZZLE_PERIOD = 1024;
constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + SWIZZLE_PERIOD - 1) / SWIZZLE_PERIOD * SWIZZLE_PERIOD;
constexpr int A_RUNS = BM / VEC, B_RUNS = BN / VEC;
// Each thread copies one 16-byte channel run of every STEP-th pixel of the x tile and of the halo: its run,
// first pixel and swizzled destination are set once, and the destinations move by whole swizzle periods.
constexpr int A_STEP = THREADS / A_RUNS, B_STEP = THREADS / B_RUNS;
constexpr int A_COPIES = TILE_PIXELS / A_STEP, B_COPIES = (HALO_PIXELS + B_STEP - 1) / B_STEP;
// Bytes from one group of eight K pixels to the next: the next row of a 2-D tile, the next eight pixels of a
// one-row tile.
constexpr bool ONE_ROW = TILE_H == 1;
constexpr int A_CORE = 8 * ROW, B_CORE = (ONE_ROW ? 8 : HALO_W) * ROW;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "MN-major operands exist for 16-bit types only");
static_assert(CIN_G % VEC == 0 && COUT_G % VEC == 0, "channels in whole 16-byte runs");
static_assert(BN % 64 == 0, "the halo is read in 64-channel blocks");
static_assert((TILE_H % 2 == 0 && TILE_W == 8) || (ONE_ROW && TILE_W % 16 == 0),
              "one MMA takes two core matrices of eight pixels: two rows, or sixteen pixels of one row");
static_assert(!SINGLE_CHUNK || TAPS == 1 || WEIGHT_CL, "tap-major partials are the weight's layout only for one tap");
static_assert(TAP_GROUP >= 1 && TAP_GROUP <= 4, "a block accumulates one to four taps");
static_assert(STAGES >= 3, "one tile copied ahead and one whose MMAs are in flight");
static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");
static_assert(THREADS % A_RUNS == 0 && THREADS % B_RUNS == 0 && TILE_PIXELS % A_STEP == 0, "whole copy rounds");
static_assert(A_STEP * ROW % SWIZZLE_PERIOD == 0 && B_STEP * ROW % SWIZZLE_PERIOD == 0 && A_BYTES % SWIZZLE_PERIOD == 0,
              "a thread's destinations one swizzle apart");

// A ring of STAGES buffers with LOOKAHEAD tiles copied ahead, and each step's MMAs left in
// flight while the next step waits, issues its copies and starts its own: the buffer a step
// refills held the tile two steps back, whose MMAs the previous step's wait<1> retired.
// Unless SKIP_ABSENT_TAPS, no branch falls between the MMAs of a step (ptxas would make each tap's
// first MMA wait for its registers): a block of fewer taps runs its group's absent ones on its
// first tap's origin and never stores them.  (A loop built per tap count instead ran out of
// registers for ptxas's wgmma pipeline on some tiles.)
constexpr int LOOKAHEAD = STAGES - 2;
template <bool SKIP, typename Issue>
__device__ __forceinline__ void accumulate(float (&acc)[TAP_GROUP][BN / 2], const int (&offsets)[TAP_GROUP],
                                           int taps, unsigned ring, int k_tiles, int wg, Issue& issue) {
#pragma unroll
    for (int s = 0; s < LOOKAHEAD; ++s) {
        if (s < k_tiles) issue(s, s);
        cp_async_commit();   // empty groups keep the wait count uniform
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<LOOKAHEAD - 1>();
        fence_async_shared();   // hands cp.async's writes to the tensor cores' async proxy
        // Tile kt has landed for every thread, and every warpgroup has retired the MMAs of tile kt - 2.
        __syncthreads();
        const int next = kt + LOOKAHEAD;
        if (next < k_tiles) issue(next, next % STAGES);
        cp_async_commit();
        const unsigned a_base = ring + (kt % STAGES) * STAGE_BYTES + wg * A_BLOCK;
        const unsigned b_base = ring + (kt % STAGES) * STAGE_BYTES + A_BYTES;
#pragma unroll
        for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < TAP_GROUP; ++t) {
            if (SKIP && t >= taps) continue;
#pragma unroll
            for (int kk = 0; kk < TILE_PIXELS / 16; ++kk) {
                // K groups 2kk and 2kk + 1: input rows 2kk and 2kk + 1, or pixels 16kk to 16kk + 15.
                const unsigned long long a = smem_descriptor_swizzle_128b(a_base + kk * 2 * A_CORE, A_BLOCK, A_CORE);
                const unsigned long long b =
                    smem_descriptor_swizzle_128b(b_base + offsets[t] + kk * 2 * B_CORE, B_BLOCK, B_CORE);
                wgmma_async<KIND, BN, 1>(acc[t], a, b, 1);
            }
        }
        wgmma_commit();
        wgmma_wait<1>();
#pragma unroll
        for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);
    cp_async_wait<0>();
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
conv_transpose2d_grad_weight_wgmma(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                   partial_t* __restrict__ partial, index_t N, index_t H, index_t W,
                                   index_t H_out, index_t W_out, index_t k_tiles_per_split) {
    extern __shared__ __align__(128) unsigned char smem[];   // STAGES x (x tile, grad_out halo), and alignment
    __shared__ int tap_ids[TAP_GROUP], tap_offsets[TAP_GROUP];
    __shared__ int tap_count, base_h, base_w;

    const int tid = threadIdx.x, wg = tid / 128, warp = tid % 128 / 32, lane = tid % 32;
    const int phase = blockIdx.x % PHASES, chunk = blockIdx.x / PHASES % TAP_CHUNKS;
    const int g = blockIdx.x / (PHASES * TAP_CHUNKS);
    const int rh = phase / SW, rw = phase % SW;
    const int m0 = (blockIdx.y / N_TILES) * BM, n0 = (blockIdx.y % N_TILES) * BN;

    if (tid == 0) {
        tap_count = find_phase_taps<TAP_GROUP>(rh, rw, chunk, HALO_W, tap_ids, tap_offsets, base_h, base_w);
        for (int t = 0; t < tap_count; ++t) tap_offsets[t] *= ROW;   // halo pixels -> bytes
    }
    __syncthreads();
    const int taps = tap_count;
    if (taps == 0) return;   // uniform per block
    const int lo_h = base_h, lo_w = base_w;

    const index_t tiles_w = (W + TILE_W - 1) / TILE_W, tiles_h = (H + TILE_H - 1) / TILE_H;
    const index_t k_tiles_total = N * tiles_h * tiles_w;
    const index_t kt0 = static_cast<index_t>(blockIdx.z) * k_tiles_per_split;
    const index_t kt1 = kt0 + k_tiles_per_split < k_tiles_total ? kt0 + k_tiles_per_split : k_tiles_total;
    const int k_tiles = kt1 > kt0 ? static_cast<int>(kt1 - kt0) : 0;
    const scalar_t* x_group = x + g * CIN_G + m0;
    const scalar_t* go_group = grad_out + g * COUT_G + n0;

    const unsigned ring = (smem_addr(smem) + SWIZZLE_PERIOD - 1) & ~(SWIZZLE_PERIOD - 1u);
    const int a_run = tid % A_RUNS, a_pixel = tid / A_RUNS, b_run = tid % B_RUNS, b_pixel = tid / B_RUNS;
    const bool a_run_ok = m0 + a_run * VEC < CIN_G, b_run_ok = n0 + b_run * VEC < COUT_G;
    const unsigned a_dst = swizzle_128b(a_run / 8 * A_BLOCK + a_pixel * ROW + a_run % 8 * 16);
    const unsigned b_dst = A_BYTES + swizzle_128b(b_run / 8 * B_BLOCK + b_pixel * ROW + b_run % 8 * 16);
    // The copies of tile kt into stage s.  A tile (or halo) wholly inside its source tests no pixel.
    auto issue = [&](int kt, int s) {
        const unsigned stage = ring + s * STAGE_BYTES;
        const index_t tile = kt0 + kt;
        const index_t n = tile / (tiles_h * tiles_w);
        const index_t i0 = tile / tiles_w % tiles_h * TILE_H, j0 = tile % tiles_w * TILE_W;
        const scalar_t* a_src = x_group + ((n * H + i0) * W + j0) * CIN + a_run * VEC;
        const bool a_inside = i0 + TILE_H <= H && j0 + TILE_W <= W;
#pragma unroll
        for (int k = 0; k < A_COPIES; ++k) {
            const int p = a_pixel + k * A_STEP, r = p / TILE_W, q = p % TILE_W;
            const bool ok = a_run_ok && (a_inside || (i0 + r < H && j0 + q < W));
            cp_async_16(stage + a_dst + k * A_STEP * ROW, ok ? a_src + (r * W + q) * CIN : x, ok);
        }
        const index_t oh0 = static_cast<index_t>(SH) * (i0 + lo_h) + rh;
        const index_t ow0 = static_cast<index_t>(SW) * (j0 + lo_w) + rw;
        // The halo origin may lie outside grad_out (read only at pixels inside it); the plan's offset type holds
        // an origin past the last image.
        const scalar_t* b_src = go_group + ((n * H_out + oh0) * W_out + ow0) * COUT + b_run * VEC;
        const bool b_inside =
            oh0 >= 0 && ow0 >= 0 && oh0 + SH * (HALO_H - 1) < H_out && ow0 + SW * (HALO_W - 1) < W_out;
#pragma unroll
        for (int k = 0; k < B_COPIES; ++k) {
            const int p = b_pixel + k * B_STEP, r = p / HALO_W, q = p % HALO_W;
            if (HALO_PIXELS % B_STEP != 0 && k == B_COPIES - 1 && p >= HALO_PIXELS) break;
            const index_t oh = oh0 + SH * r, ow = ow0 + SW * q;
            const bool ok = b_run_ok && (b_inside || (oh >= 0 && oh < H_out && ow >= 0 && ow < W_out));
            cp_async_16(stage + b_dst + k * B_STEP * ROW,
                        ok ? b_src + (static_cast<index_t>(SH * r) * W_out + SW * q) * COUT : grad_out, ok);
        }
    };

    int offsets[TAP_GROUP];   // the taps' halo origins, in registers for the descriptors
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) offsets[t] = tap_offsets[t < taps ? t : 0];
    float acc[TAP_GROUP][BN / 2];
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[t][e] = 0.0f;

    accumulate<SKIP_ABSENT_TAPS>(acc, offsets, taps, ring, k_tiles, wg, issue);

    // one copy of the partials per split (grad_weight itself for SINGLE_CHUNK)
    partial_t* out = partial + static_cast<index_t>(blockIdx.z) * TAPS * CIN * COUT_G;
    store_tap_partials<TAP_GROUP, BN>(acc, taps, tap_ids, out, g, m0, n0, wg, warp, lane);
}
