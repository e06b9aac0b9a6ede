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
// Every word is its own 4-byte cp.async, so both layouts are read in place: a warp copies four
// 32-byte runs (NCHW: 8 pixels x 4 images of one channel; NHWC: 8 channels x 4 images of one
// pixel), and planes padded by 16 bytes put its 32 words on distinct banks either way.  A lane's
// words of one slot differ only by channel, so each costs an add and the copy.  The tensor
// cores drop the low 13 bits of fp32 words, so a landed stage is rounded in place (cvt.rna, as the
// mma.sync GEMMs round their fragments) before any MMA reads it.
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
constexpr bool NHWC = {{NHWC}};
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
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;

static_assert(sizeof(scalar_t) == 4, "TF32 operands are fp32 words");
static_assert(TILE_W % 2 == 0, "one MMA takes two neighbouring pixels of a row");
static_assert(TAP_GROUP >= 1 && TAP_GROUP <= 4, "a block accumulates one to four taps");
static_assert(!SINGLE_CHUNK || TAPS == 1 || WEIGHT_CL, "tap-major partials are the weight's layout only for one tap");
static_assert(STAGES >= 3, "one tile copied ahead and one whose MMAs are in flight");
static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");

__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0));
}

constexpr int WARPS = THREADS / 32;

// Copies one operand's words of a stage: CHANNELS channels (the first `channels` of which exist) of SLOT_COUNT
// slots into planes PLANE bytes apart from `dst`.  locate(slot, image, at) says whether image `image`'s pixel of
// that slot exists and sets `at` to its element offset at the tile's first channel; channels lie `channel_stride`
// elements apart.  A lane copies image lane / 8; its other coordinate runs along the source's contiguous axis,
// so a warp reads four 32-byte runs: NCHW, pixels (a warp takes channels warp, warp + WARPS, ... of every octet
// of slots); NHWC, channels (a warp takes slots warp, warp + WARPS, ..., each a whole channel row).  The
// address arithmetic is paid once per slot, each channel only adding its stride.
template <int CHANNELS, int SLOT_COUNT, int PLANE, typename Locate>
__device__ __forceinline__ void copy_operand(unsigned dst, const scalar_t* src, index_t channel_stride, int channels,
                                             Locate& locate, int warp_id, int lane) {
    const int image = lane / 8, sub = lane % 8;
    if constexpr (NHWC) {
#pragma unroll
        for (int s0 = 0; s0 < SLOT_COUNT; s0 += WARPS) {
            const int slot = s0 + warp_id;
            if (SLOT_COUNT % WARPS != 0 && slot >= SLOT_COUNT) break;
            index_t at;
            const bool ok = locate(slot, image, at);
#pragma unroll
            for (int c = sub; c < CHANNELS; c += 8) {
                const bool in = ok && c < channels;
                cp_async_4(dst + slot * PLANE + c * 16 + image * 4, in ? src + at + c : src, in);
            }
        }
    } else {
#pragma unroll
        for (int octet = 0; octet < (SLOT_COUNT + 7) / 8; ++octet) {
            const int slot = octet * 8 + sub;
            if (SLOT_COUNT % 8 != 0 && slot >= SLOT_COUNT) break;
            index_t at;
            const bool ok = locate(slot, image, at);
#pragma unroll
            for (int c0 = 0; c0 < CHANNELS; c0 += WARPS) {
                const int c = c0 + warp_id;
                const bool in = ok && c < channels;
                cp_async_4(dst + slot * PLANE + c * 16 + image * 4, in ? src + at + c * channel_stride : src, in);
            }
        }
    }
}

// The 16-bit kernel's ring (STAGES buffers, STAGES - 2 tiles copied ahead, one step's MMAs in flight
// while the next waits), with a rounding pass between a stage landing and its MMAs: every thread
// rounds a share of the stage, fences the async proxy, and a second barrier hands it over.
// A block with fewer taps than TAP_GROUP still runs every tap's MMAs, its idle taps reading the
// first tap's window into accumulators that are never stored: a branch between the MMAs makes
// ptxas serialise them (C7515), which measured slower on the large ragged layer (NOTES v14).
constexpr int LOOKAHEAD = STAGES - 2;
template <typename Issue>
__device__ __forceinline__ void accumulate(float (&acc)[TAP_GROUP][BN / 2], const int (&offsets)[TAP_GROUP],
                                           unsigned char* smem, int k_tiles, int wg, int tid,
                                           Issue& issue) {
#pragma unroll
    for (int s = 0; s < LOOKAHEAD; ++s) {
        if (s < k_tiles) issue(s, s);
        cp_async_commit();   // empty groups keep the wait count uniform
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<LOOKAHEAD - 1>();
        // Tile kt has landed for every thread, and every warpgroup has retired the MMAs of tile kt - 2.
        __syncthreads();
        const int next = kt + LOOKAHEAD;
        if (next < k_tiles) issue(next, next % STAGES);
        cp_async_commit();
        const unsigned stage = smem_addr(smem + (kt % STAGES) * STAGE_BYTES);
        for (int v = tid; v < STAGE_BYTES / 16; v += THREADS) round_shared_tf32(stage + v * 16);
        fence_async_shared();   // hands the rounded words to the tensor cores' async proxy
        __syncthreads();
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
                    wgmma_async<MMA_TF32, BN>(acc[t], a, b, 1);
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
conv_transpose2d_grad_weight_wgmma_tf32(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                        partial_t* __restrict__ partial, index_t N, index_t H, index_t W,
                                        index_t H_out, index_t W_out, index_t k_tiles_per_split) {
    extern __shared__ __align__(128) unsigned char smem[];   // STAGES x (x tile, grad_out halo)
    __shared__ int tap_ids[TAP_GROUP], tap_origins[TAP_GROUP];
    __shared__ int tap_count, base_h, base_w;

    const int tid = threadIdx.x, wg = tid / 128, warp = tid % 128 / 32, warp_id = tid / 32, lane = tid % 32;
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
    auto issue = [&](int kt, int s) {
        const unsigned a_tile = smem_addr(smem + s * STAGE_BYTES), b_tile = a_tile + A_BYTES;
        const index_t tile = kt0 + kt;
        const index_t image0 = tile / (tiles_h * tiles_w) * (QUADS * IMAGES);
        const index_t i0 = tile / tiles_w % tiles_h * TILE_H, j0 = tile % tiles_w * TILE_W;
        auto locate_x = [&](int slot, int image, index_t& at) {
            const int p = slot % TILE_PIXELS;
            const index_t n = image0 + slot / TILE_PIXELS * IMAGES + image;
            const index_t i = i0 + p / TILE_W, j = j0 + p % TILE_W;
            at = NHWC ? ((n * H + i) * W + j) * CIN + ic0 : ((n * CIN + ic0) * H + i) * W + j;
            return n < N && i < H && j < W;
        };
        auto locate_go = [&](int slot, int image, index_t& at) {
            const int p = slot % HALO_PIXELS;
            const index_t n = image0 + slot / HALO_PIXELS * IMAGES + image;
            const index_t oh = static_cast<index_t>(SH) * (i0 + p / HALO_W + lo_h) + rh;
            const index_t ow = static_cast<index_t>(SW) * (j0 + p % HALO_W + lo_w) + rw;
            at = NHWC ? ((n * H_out + oh) * W_out + ow) * COUT + oc0 : ((n * COUT + oc0) * H_out + oh) * W_out + ow;
            return n < N && oh >= 0 && oh < H_out && ow >= 0 && ow < W_out;
        };
        copy_operand<BM, SLOTS, A_PLANE>(a_tile, x, NHWC ? 1 : H * W, channels_a, locate_x, warp_id, lane);
        copy_operand<BN, HALO_SLOTS, B_PLANE>(b_tile, grad_out, NHWC ? 1 : H_out * W_out, channels_b, locate_go,
                                              warp_id, lane);
    };

    int offsets[TAP_GROUP];   // the taps' halo origins in bytes, in registers for the descriptors
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) offsets[t] = tap_origins[t < taps ? t : 0] * B_PLANE;
    float acc[TAP_GROUP][BN / 2];
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[t][e] = 0.0f;

    accumulate(acc, offsets, smem, k_tiles, wg, tid, issue);

    // one copy of the partials per split (grad_weight itself for SINGLE_CHUNK)
    partial_t* out = partial + static_cast<index_t>(blockIdx.z) * TAPS * CIN * COUT_G;
    store_tap_partials<TAP_GROUP, BN>(acc, taps, tap_ids, out, g, m0, n0, wg, warp, lane);
}
