// grad_weight of a float32 transposed convolution at TF32 precision on Hopper's warpgroup MMA
// (wgmma, sm_90a).  The GEMM is conv_transpose2d_grad_weight_wgmma.cu's: per group and stride
// phase, M = input channels, N = output channels, K = every (image, input pixel), a few taps of
// the phase at once, each tap reading one grad_out halo from a moved origin.
//
// TF32 wgmma takes K-major operands only: a core matrix is 8 rows of M or N, each 16 bytes (four
// words) of K.  Four words of K that a tap's pixel shift keeps together are four images at one
// pixel, so K runs over (pixel, image) with images innermost: a 16-byte slot holds one channel of
// four images at one pixel, a pixel's slots for the tile's channels form a plane [channel][4
// images], and a tap shifted by a pixel starts a plane further on, which a descriptor addresses.
// (With pixels innermost, a one-pixel shift would fall inside a slot.)  A K step is QUADS groups
// of four images x TILE_H x TILE_W input pixels, and the halo the same over the phase's span.
//
// Both operands come packed by to_image_quads.cu as [n / 4][pixel][channel][n % 4], rounded to TF32 (the
// tensor cores would drop the low 13 bits of fp32 words unrounded), so a plane is one contiguous run of the
// packed source: a thread copies one channel's 16-byte slot of a row's planes, a warp 512 contiguous bytes, and
// the copies coalesce.  (Read in place, every word was its own 4-byte cp.async, an L2 request of one sector, and
// a landed stage needed a rounding pass: 1.3-2.3x slower on every layer measured.)
//
// Strict float32 (SPLIT_TF32) runs as 3xTF32: both packed sources come as two copies, TF32 big parts and their
// TF32 residuals, and a stage holds both parts of both operands.  Each K tile issues small x big, big x small and
// big x big into fresh accumulators, waits for them and adds them into an fp32 total (the tensor cores' own
// accumulation is not rounded to nearest), so its tiles hold at most 64 accumulators a thread in each set.
//
// Split-K, the tap-major partials and their fixed-order reduction are the 16-bit kernel's.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"
#include "grad_weight_phase_taps.cuh"

constexpr int WARPGROUPS = {{WARPGROUPS}};   // each owns 64 input channels of the tile
constexpr int BM = 64 * WARPGROUPS, BN = {{BN}};
constexpr int TAP_GROUP = {{TAP_GROUP}};     // taps a block accumulates side by side
constexpr int TILE_H = {{TILE_H}}, TILE_W = {{TILE_W}};
constexpr int QUADS = {{QUADS}};             // groups of four images in a K step
constexpr int SPAN_H = {{SPAN_H}}, SPAN_W = {{SPAN_W}};   // the widest spread of one phase's tap shifts
constexpr int STAGES = {{STAGES}};
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
constexpr bool SPLIT_TF32 = {{SPLIT_TF32}};
constexpr int PARTS = SPLIT_TF32 ? 2 : 1;
constexpr int TAP_CHUNKS = {{TAP_CHUNKS}};   // tap groups of the phase with the most taps
typedef PartialOut<SINGLE_CHUNK, scalar_t, float>::type partial_t;

constexpr int THREADS = 128 * WARPGROUPS;
constexpr int IMAGES = 4;   // fp32 words in a 16-byte slot
constexpr int PHASES = SH * SW;
constexpr int M_TILES = (CIN_G + BM - 1) / BM, N_TILES = (COUT_G + BN - 1) / BN;
constexpr int TILE_PIXELS = TILE_H * TILE_W, SLOTS = QUADS * TILE_PIXELS;
constexpr int HALO_H = TILE_H + SPAN_H, HALO_W = TILE_W + SPAN_W, HALO_PIXELS = HALO_H * HALO_W;
constexpr int HALO_SLOTS = QUADS * HALO_PIXELS;
constexpr int A_PLANE = BM * 16 + 16, B_PLANE = BN * 16 + 16;
constexpr int A_BYTES = SLOTS * A_PLANE, B_BYTES = HALO_SLOTS * B_PLANE;
constexpr int PART_BYTES = A_BYTES + B_BYTES;   // a stage: [x tile, grad_out halo] per part
constexpr int STAGE_BYTES = PARTS * PART_BYTES;

static_assert(sizeof(scalar_t) == 4, "TF32 operands are fp32 words");
static_assert(TILE_W % 2 == 0, "one MMA takes two neighbouring pixels of a row");
static_assert(TAP_GROUP >= 1 && TAP_GROUP <= 4, "a block accumulates one to four taps");
static_assert(!SPLIT_TF32 || TAP_GROUP * BN / 2 <= 64, "3xTF32 keeps two sets of at most 64 accumulators");
static_assert(!SINGLE_CHUNK || TAPS == 1 || WEIGHT_CL, "tap-major partials are the weight's layout only for one tap");
static_assert(STAGES >= (SPLIT_TF32 ? 2 : 3), "one tile copied ahead, and one whose MMAs are in flight unless each "
                                              "K tile waits for its own (3xTF32)");
static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");
static_assert(THREADS % BM == 0 && THREADS % BN == 0, "whole planes per copy round");

// Copies one packed operand's planes of a stage: ROWS rows of COLS planes (image groups x pixel rows, then the
// pixels of a row), each plane CHANNELS 16-byte slots (the first `channels` of which exist), PLANE bytes apart
// from `dst`.  locate_row(row, at) says whether the row exists and sets `at` to its first pixel's run in `src`;
// neighbouring planes of a row lie COL_STRIDE slots apart there, and col_ok(col) says whether a column exists.
// A thread copies one channel of every STEP-th row, whole: its rows' arithmetic is paid once a row, each plane
// only a test and a copy at a fixed offset.  A warp copies 32 neighbouring slots of one plane: 512 contiguous
// bytes on both sides.
template <int CHANNELS, int ROWS, int COLS, int PLANE, int COL_STRIDE, typename LocateRow, typename ColOk>
__device__ __forceinline__ void copy_packed(unsigned dst, const float4* src, int channels, LocateRow& locate_row,
                                            ColOk& col_ok, int tid) {
    constexpr int STEP = THREADS / CHANNELS;
    const int c = tid % CHANNELS;
    const bool channel_ok = c < channels;
    for (int row = tid / CHANNELS; row < ROWS; row += STEP) {
        index_t at;
        const bool row_ok = locate_row(row, at) && channel_ok;
        const float4* from = src + at + c;
        const unsigned to = dst + row * COLS * PLANE + c * 16;
#pragma unroll
        for (int col = 0; col < COLS; ++col) {
            const bool ok = row_ok && col_ok(col);
            cp_async_16(to + col * PLANE, ok ? from + col * COL_STRIDE : src, ok);
        }
    }
}

// The 16-bit kernel's ring (STAGES buffers, STAGES - 2 tiles copied ahead, one step's MMAs in flight
// while the next waits); 3xTF32's steps wait for their MMAs, so it copies STAGES - 1 tiles ahead.
// A block with fewer taps than TAP_GROUP still runs every tap's MMAs, its idle taps reading the
// first tap's window into accumulators that are never stored: a branch between the MMAs makes
// ptxas serialise them (C7515), which measured slower on the large ragged layer (NOTES v14).
constexpr int LOOKAHEAD = SPLIT_TF32 ? STAGES - 1 : STAGES - 2;
template <typename Issue>
__device__ __forceinline__ void accumulate(float (&acc)[TAP_GROUP][BN / 2], float (&total)[TAP_GROUP][BN / 2],
                                           const int (&offsets)[TAP_GROUP], unsigned char* smem, int k_tiles, int wg,
                                           Issue& issue) {
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
        const unsigned stage = smem_addr(smem + (kt % STAGES) * STAGE_BYTES);
        const unsigned a_base = stage + wg * 8 * 128;   // the warpgroup's 64 channels: eight core matrices
        const unsigned b_base = stage + A_BYTES;
#pragma unroll
        for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < TAP_GROUP; ++t) {
#pragma unroll
            for (int q = 0; q < QUADS; ++q)
#pragma unroll
                for (int p = 0; p < TILE_PIXELS; p += 2) {
                    // Pixels p and p + 1 of a row: two core matrices along K, a plane apart.
                    const int halo = q * HALO_PIXELS + p / TILE_W * HALO_W + p % TILE_W;
                    const unsigned long long a = smem_descriptor(a_base + (q * TILE_PIXELS + p) * A_PLANE, A_PLANE, 128);
                    const unsigned long long b = smem_descriptor(b_base + offsets[t] + halo * B_PLANE, B_PLANE, 128);
                    if constexpr (SPLIT_TF32) {
                        // Small cross terms first; each K tile starts its sum afresh.
                        constexpr unsigned long long SMALL = PART_BYTES >> 4;   // descriptors count 16 bytes
                        wgmma_async<MMA_TF32, BN>(acc[t], a + SMALL, b, q > 0 || p > 0);
                        wgmma_async<MMA_TF32, BN>(acc[t], a, b + SMALL, 1);
                    }
                    wgmma_async<MMA_TF32, BN>(acc[t], a, b, 1);
                }
        }
        wgmma_commit();
        if constexpr (SPLIT_TF32) {
            wgmma_wait<0>();
#pragma unroll
            for (int t = 0; t < TAP_GROUP; ++t) {
                fence_registers(acc[t]);
#pragma unroll
                for (int e = 0; e < BN / 2; ++e) total[t][e] += acc[t][e];
            }
        } else {
            wgmma_wait<1>();
#pragma unroll
            for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);
        }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);
    cp_async_wait<0>();
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
conv_transpose2d_grad_weight_wgmma_tf32(const float4* __restrict__ x_quads, const float4* __restrict__ grad_out_quads,
                                        partial_t* __restrict__ partial, index_t N, index_t H, index_t W,
                                        index_t H_out, index_t W_out, index_t k_tiles_per_split) {
    extern __shared__ __align__(128) unsigned char smem[];   // STAGES x (x tile, grad_out halo)
    __shared__ int tap_ids[TAP_GROUP], tap_origins[TAP_GROUP];
    __shared__ int tap_count, base_h, base_w;

    const int tid = threadIdx.x, wg = tid / 128, warp = tid % 128 / 32, lane = tid % 32;
    const int phase = blockIdx.x % PHASES, chunk = blockIdx.x / PHASES % TAP_CHUNKS;
    const int g = blockIdx.x / (PHASES * TAP_CHUNKS);
    const int rh = phase / SW, rw = phase % SW;
    const int m0 = (blockIdx.y / N_TILES) * BM, n0 = (blockIdx.y % N_TILES) * BN;

    if (tid == 0) tap_count = find_phase_taps<TAP_GROUP>(rh, rw, chunk, HALO_W, tap_ids, tap_origins, base_h, base_w);
    __syncthreads();
    const int taps = tap_count;
    if (taps == 0) return;   // uniform per block
    const int lo_h = base_h, lo_w = base_w;

    const index_t tiles_w = (W + TILE_W - 1) / TILE_W, tiles_h = (H + TILE_H - 1) / TILE_H;
    const index_t k_tiles_total = (N + QUADS * IMAGES - 1) / (QUADS * IMAGES) * tiles_h * tiles_w;
    const index_t kt0 = static_cast<index_t>(blockIdx.z) * k_tiles_per_split;
    const index_t kt1 = kt0 + k_tiles_per_split < k_tiles_total ? kt0 + k_tiles_per_split : k_tiles_total;
    const int k_tiles = kt1 > kt0 ? static_cast<int>(kt1 - kt0) : 0;
    const index_t ic0 = static_cast<index_t>(g) * CIN_G + m0, oc0 = static_cast<index_t>(g) * COUT_G + n0;

    const int channels_a = CIN_G - m0 < BM ? CIN_G - m0 : BM, channels_b = COUT_G - n0 < BN ? COUT_G - n0 : BN;
    // 3xTF32: the residuals' copy of each source right after its big parts
    const index_t quads_all = (N + IMAGES - 1) / IMAGES;
    const index_t x_part = quads_all * H * W * CIN, go_part = quads_all * H_out * W_out * COUT;
    auto issue = [&](int kt, int s) {
        const unsigned a_tile = smem_addr(smem + s * STAGE_BYTES), b_tile = a_tile + A_BYTES;
        const index_t tile = kt0 + kt;
        const index_t image0 = tile / (tiles_h * tiles_w) * (QUADS * IMAGES);
        const index_t i0 = tile / tiles_w % tiles_h * TILE_H, j0 = tile % tiles_w * TILE_W;
        const index_t quad0 = image0 / IMAGES, quads = (N + IMAGES - 1) / IMAGES;
        auto x_row = [&](int row, index_t& at) {
            const index_t q = quad0 + row / TILE_H, i = i0 + row % TILE_H;
            at = ((q * H + i) * W + j0) * CIN + ic0;
            return q < quads && i < H;
        };
        auto x_col = [&](int col) { return j0 + col < W; };
        const index_t ow0 = static_cast<index_t>(SW) * (j0 + lo_w) + rw;
        auto go_row = [&](int row, index_t& at) {
            const index_t q = quad0 + row / HALO_H;
            const index_t oh = static_cast<index_t>(SH) * (i0 + row % HALO_H + lo_h) + rh;
            at = ((q * H_out + oh) * W_out + ow0) * COUT + oc0;
            return q < quads && oh >= 0 && oh < H_out;
        };
        auto go_col = [&](int col) { return ow0 + SW * col >= 0 && ow0 + SW * col < W_out; };
#pragma unroll
        for (int part = 0; part < PARTS; ++part) {
            copy_packed<BM, QUADS * TILE_H, TILE_W, A_PLANE, CIN>(a_tile + part * PART_BYTES, x_quads + part * x_part,
                                                                  channels_a, x_row, x_col, tid);
            copy_packed<BN, QUADS * HALO_H, HALO_W, B_PLANE, SW * COUT>(b_tile + part * PART_BYTES,
                                                                        grad_out_quads + part * go_part, channels_b,
                                                                        go_row, go_col, tid);
        }
    };

    int offsets[TAP_GROUP];   // the taps' halo origins in bytes, in registers for the descriptors
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) offsets[t] = tap_origins[t < taps ? t : 0] * B_PLANE;
    float acc[TAP_GROUP][BN / 2], total[TAP_GROUP][BN / 2];   // total: 3xTF32's fp32 sums of its K tiles
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[t][e] = total[t][e] = 0.0f;

    accumulate(acc, total, offsets, smem, k_tiles, wg, issue);

    // one copy of the partials per split (grad_weight itself for SINGLE_CHUNK)
    partial_t* out = partial + static_cast<index_t>(blockIdx.z) * TAPS * CIN * COUT_G;
    store_tap_partials<TAP_GROUP, BN>(SPLIT_TF32 ? total : acc, taps, tap_ids, out, g, m0, n0, wg, warp, lane);
}
