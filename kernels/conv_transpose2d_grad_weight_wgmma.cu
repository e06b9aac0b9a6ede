// grad_weight of a transposed convolution on Hopper's warpgroup MMA (wgmma, sm_90a): per
// group, a split-K GEMM with M = input channels, N = output channels and K = every input
// pixel, for a few taps at once:
//   grad_weight[ic, oc, kh, kw] = sum over (n, i, j) of
//       x[n, i, j, ic] * grad_out[n, SH*i - PH + kh*DH, SW*j - PW + kw*DW, oc]
// Tap (kh, kw) reads grad_out row SH*(i + ah) + rh, where rh = (kh*DH - PH) mod SH is its
// row phase and ah its shift; columns likewise.  A block takes up to TAP_GROUP taps of one
// phase (rh, rw), so for a K tile of TILE_H x TILE_W input pixels it needs the x tile and one
// "halo" of the phase's grad_out pixels, (TILE_H + SPAN_H) x (TILE_W + SPAN_W), and each tap
// is that halo read from a moved origin.  Both land as rows of 128 bytes, a pixel's 64 channels of
// one 64-channel block, in the 128-byte swizzle (wgmma.cuh): so x^T (A) and grad_out (B) are
// MN-major operands, read with wgmma's transpose bits, a pixel's channel run lands as one row (its copies
// coalesce), and a tap's origin may be any row of the halo.  A K tile is 8 x 8 pixels (or 16 x 8), its groups
// of eight pixels a row apart, or, for an input of few rows (a 1-D layer's one), 1 x 64.
// Both sources are channels_last with whole 16-byte channel runs (NCHW ones are copied into
// that form first).
// One warpgroup produces: where the plan gives tensor maps (TMA), one of its threads has the copy engine
// copy the x tile and the halo, a box each per 64-channel block (the halo's box walks grad_out at the
// stride, and the engine lays both out in the 128-byte swizzle and fills what lies outside with zeros);
// else every thread issues cp.async copies of 16-byte runs.  Either lands on a stage's "full" mbarrier.  The
// others consume, one 64-channel block of x each: per stage only the wgmma instructions, then an arrival on
// the stage's "empty" mbarrier once its MMAs have retired.  (When every warp both copied and multiplied, the
// copies' address arithmetic, about 470 instructions a warp per K tile, held the tensor pipe at a quarter
// of its rate.)
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
#include "mbarrier_copy.cuh"
#include "grad_weight_phase_taps.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int WARPGROUPS = {{WARPGROUPS}};   // consumers, each owning 64 input channels of the tile
constexpr int BM = 64 * WARPGROUPS, BN = {{BN}};
constexpr int TAP_GROUP = {{TAP_GROUP}};     // taps a block accumulates side by side
constexpr int TILE_H = {{TILE_H}}, TILE_W = {{TILE_W}};
constexpr int SPAN_H = {{SPAN_H}}, SPAN_W = {{SPAN_W}};   // the widest spread of one phase's tap shifts
constexpr int STAGES = {{STAGES}};
constexpr int MIN_BLOCKS = {{MIN_BLOCKS}};   // blocks an SM holds (the plan's shared memory allows as many)
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
constexpr bool TMA = {{TMA}};   // the copy engine copies the tiles (x_map, go_map), else cp.async
typedef PartialOut<SINGLE_CHUNK, scalar_t, float>::type partial_t;

constexpr int PRODUCER_THREADS = 128;
constexpr int THREADS = 128 * WARPGROUPS + PRODUCER_THREADS;
// The producer gives up registers to the consumers (setmaxnreg, multiples of eight): the launch's share of the
// register file is 65536 / (THREADS x MIN_BLOCKS) a thread.
constexpr int LAUNCH_REGISTERS = 65536 / (THREADS * MIN_BLOCKS) / 8 * 8;
constexpr int PRODUCER_REGISTERS = {{PRODUCER_REGISTERS}};   // its unrolled copies' addresses spilled at 56
constexpr int CONSUMER_REGISTERS =
    (LAUNCH_REGISTERS * THREADS - PRODUCER_REGISTERS * PRODUCER_THREADS) / (128 * WARPGROUPS) / 8 * 8;
// One consumer alone on an SM has every register it could use already.
constexpr bool MOVES_REGISTERS = THREADS * MIN_BLOCKS > 256;
constexpr int VEC = 8;   // 16-bit channels in one 16-byte run
constexpr int PHASES = SH * SW;
constexpr int TAP_CHUNKS = {{TAP_CHUNKS}};   // tap groups of the phase with the most taps
// Whether a block tests each tap of its group (some blocks have fewer) or runs the full group (plans.wgmma)
constexpr bool SKIP_ABSENT_TAPS = {{SKIP_ABSENT_TAPS}};
constexpr int M_TILES = (CIN_G + BM - 1) / BM, N_TILES = (COUT_G + BN - 1) / BN;
constexpr int TILE_PIXELS = TILE_H * TILE_W;
constexpr int HALO_H = TILE_H + SPAN_H, HALO_W = TILE_W + SPAN_W, HALO_PIXELS = HALO_H * HALO_W;
// A stage holds the x tile and the halo as blocks of 64 channels, each a row of 128 bytes per pixel; the
// consumers read the x tile's blocks, one each, and every MMA reads all of the halo's (BN / 64).
// Stages and their 64-channel blocks start on whole swizzle periods (1024 bytes: eight rows), so a row's
// swizzle is its offset's, as the copy engine swizzles too.
constexpr int SWIZZLE_PERIOD = 1024;
constexpr int ROW = 128, A_BLOCK = TILE_PIXELS * ROW;
constexpr int B_BLOCK = (HALO_PIXELS * ROW + SWIZZLE_PERIOD - 1) / SWIZZLE_PERIOD * SWIZZLE_PERIOD;
constexpr int A_BYTES = WARPGROUPS * A_BLOCK, B_BYTES = (BN / 64) * B_BLOCK;
// What the copy engine lands in a stage: every box's bytes, those outside the tensor included.
constexpr unsigned TMA_STAGE_BYTES = (WARPGROUPS * TILE_PIXELS + BN / 64 * HALO_PIXELS) * ROW;
constexpr int STAGE_BYTES = (A_BYTES + B_BYTES + SWIZZLE_PERIOD - 1) / SWIZZLE_PERIOD * SWIZZLE_PERIOD;
constexpr int A_RUNS = BM / VEC, B_RUNS = BN / VEC;
// Each producer thread copies one 16-byte channel run of every STEP-th pixel of the x tile and of the halo.
constexpr int A_STEP = PRODUCER_THREADS / A_RUNS, B_STEP = PRODUCER_THREADS / B_RUNS;
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
static_assert(STAGES >= 2, "one tile landing while another's MMAs run");
static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");
static_assert(PRODUCER_THREADS % A_RUNS == 0 && PRODUCER_THREADS % B_RUNS == 0 && TILE_PIXELS % A_STEP == 0,
              "whole copy rounds");
static_assert(A_BLOCK % SWIZZLE_PERIOD == 0, "the x tile's blocks start on swizzle periods");
static_assert(!MOVES_REGISTERS || (PRODUCER_REGISTERS <= LAUNCH_REGISTERS && CONSUMER_REGISTERS >= LAUNCH_REGISTERS
              && CONSUMER_REGISTERS <= 256 && CONSUMER_REGISTERS >= TAP_GROUP * BN / 2 + 32),
              "room for the accumulators");

// The swizzled offset of a producer thread's k-th copy, `base` its first copy's offset before the swizzle: a
// step of whole swizzle periods keeps the swizzle of the first copy.
template <int STEP_BYTES>
__device__ __forceinline__ unsigned copy_offset(unsigned base, int k) {
    if constexpr (STEP_BYTES % SWIZZLE_PERIOD == 0) return swizzle_128b(base) + k * STEP_BYTES;
    else return swizzle_128b(base + k * STEP_BYTES);
}

#if {{TMA}}
#define TENSOR_MAPS , const __grid_constant__ TensorMap x_map, const __grid_constant__ TensorMap go_map
#else
#define TENSOR_MAPS
#endif

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
conv_transpose2d_grad_weight_wgmma(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                   partial_t* __restrict__ partial, index_t N, index_t H, index_t W,
                                   index_t H_out, index_t W_out, index_t k_tiles_per_split TENSOR_MAPS) {
    extern __shared__ __align__(128) unsigned char smem[];   // STAGES x (x tile, grad_out halo), and alignment
    __shared__ int tap_ids[TAP_GROUP], tap_offsets[TAP_GROUP];
    __shared__ int tap_count, base_h, base_w;
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];

    const int tid = threadIdx.x, wg = tid / 128, warp = tid % 128 / 32, lane = tid % 32;
    const int phase = blockIdx.x % PHASES, chunk = blockIdx.x / PHASES % TAP_CHUNKS;
    const int g = blockIdx.x / (PHASES * TAP_CHUNKS);
    const int rh = phase / SW, rw = phase % SW;
    const int m0 = (blockIdx.y / N_TILES) * BM, n0 = (blockIdx.y % N_TILES) * BN;

    if (tid == 0) {
        tap_count = find_phase_taps<TAP_GROUP>(rh, rw, chunk, HALO_W, tap_ids, tap_offsets, base_h, base_w);
        for (int t = 0; t < tap_count; ++t) tap_offsets[t] *= ROW;   // halo pixels -> bytes
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(smem_addr(&full[s]), TMA ? 1 : PRODUCER_THREADS);   // the copy engine's, or every thread's
            mbarrier_init(smem_addr(&empty[s]), WARPGROUPS);        // one arrival a consumer
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    const int taps = tap_count;
    if (taps == 0) return;   // uniform per block

    const index_t tiles_w = (W + TILE_W - 1) / TILE_W, tiles_h = (H + TILE_H - 1) / TILE_H;
    const index_t k_tiles_total = N * tiles_h * tiles_w;
    const index_t kt0 = static_cast<index_t>(blockIdx.z) * k_tiles_per_split;
    const index_t kt1 = kt0 + k_tiles_per_split < k_tiles_total ? kt0 + k_tiles_per_split : k_tiles_total;
    const int k_tiles = kt1 > kt0 ? static_cast<int>(kt1 - kt0) : 0;
    const unsigned ring = (smem_addr(smem) + SWIZZLE_PERIOD - 1) & ~(SWIZZLE_PERIOD - 1u);

    if (wg == WARPGROUPS) {
        // ------------------------------------------------------------------ producer
        if constexpr (MOVES_REGISTERS) registers_release<PRODUCER_REGISTERS>();
        const int ptid = tid % 128;
        const int lo_h = base_h, lo_w = base_w;
#if {{TMA}}
        if (ptid == 0) {
            // Whole-tensor coordinates: channel, column, row, image.
            const int c_x = g * CIN_G + m0, c_go = g * COUT_G + n0;
            const int tiles = static_cast<int>(tiles_h * tiles_w), first = static_cast<int>(kt0);
            int n = first / tiles, i0 = first / static_cast<int>(tiles_w) % static_cast<int>(tiles_h) * TILE_H;
            int j0 = first % static_cast<int>(tiles_w) * TILE_W;
            for (int kt = 0; kt < k_tiles; ++kt) {
                const int s = kt % STAGES;
                mbarrier_wait(smem_addr(&empty[s]), ((kt / STAGES) & 1) ^ 1);
                const unsigned stage = ring + s * STAGE_BYTES, bar = smem_addr(&full[s]);
                mbarrier_expect_bytes(bar, TMA_STAGE_BYTES);
#pragma unroll
                for (int b = 0; b < WARPGROUPS; ++b)
                    tensor_copy_4d(stage + b * A_BLOCK, x_map, c_x + 64 * b, j0, i0, n, bar);
                const int oh0 = SH * (i0 + lo_h) + rh, ow0 = SW * (j0 + lo_w) + rw;
#pragma unroll
                for (int b = 0; b < BN / 64; ++b)
                    tensor_copy_4d(stage + A_BYTES + b * B_BLOCK, go_map, c_go + 64 * b, ow0, oh0, n, bar);
                j0 += TILE_W;
                if (j0 >= W) {
                    j0 = 0;
                    i0 += TILE_H;
                    if (i0 >= H) i0 = 0, ++n;
                }
            }
        }
#else
        const scalar_t* x_group = x + g * CIN_G + m0;
        const scalar_t* go_group = grad_out + g * COUT_G + n0;
        const int a_run = ptid % A_RUNS, a_pixel = ptid / A_RUNS, b_run = ptid % B_RUNS, b_pixel = ptid / B_RUNS;
        const bool a_run_ok = m0 + a_run * VEC < CIN_G, b_run_ok = n0 + b_run * VEC < COUT_G;
        const unsigned a_dst = a_run / 8 * A_BLOCK + a_pixel * ROW + a_run % 8 * 16;
        const unsigned b_dst = b_run / 8 * B_BLOCK + b_pixel * ROW + b_run % 8 * 16;
        // The K tiles run along rows, then down the image, then over images: the origin moves, no division.
        index_t n = kt0 / (tiles_h * tiles_w), i0 = kt0 / tiles_w % tiles_h * TILE_H, j0 = kt0 % tiles_w * TILE_W;
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int s = kt % STAGES;
            mbarrier_wait(smem_addr(&empty[s]), ((kt / STAGES) & 1) ^ 1);
            const unsigned stage = ring + s * STAGE_BYTES;
            // A tile (or halo) wholly inside its source tests no pixel.
            const scalar_t* a_src = x_group + ((n * H + i0) * W + j0) * CIN + a_run * VEC;
            const bool a_inside = i0 + TILE_H <= H && j0 + TILE_W <= W;
#pragma unroll
            for (int k = 0; k < A_COPIES; ++k) {
                const int p = a_pixel + k * A_STEP, r = p / TILE_W, q = p % TILE_W;
                const bool ok = a_run_ok && (a_inside || (i0 + r < H && j0 + q < W));
                cp_async_16(stage + copy_offset<A_STEP * ROW>(a_dst, k), ok ? a_src + (r * W + q) * CIN : x, ok);
            }
            const index_t oh0 = static_cast<index_t>(SH) * (i0 + lo_h) + rh;
            const index_t ow0 = static_cast<index_t>(SW) * (j0 + lo_w) + rw;
            // The halo origin may lie outside grad_out (read only at pixels inside it); the plan's offset type
            // holds an origin past the last image.
            const scalar_t* b_src = go_group + ((n * H_out + oh0) * W_out + ow0) * COUT + b_run * VEC;
            const bool b_inside =
                oh0 >= 0 && ow0 >= 0 && oh0 + SH * (HALO_H - 1) < H_out && ow0 + SW * (HALO_W - 1) < W_out;
            // Two halo copies an iteration: unrolled whole, their addresses outgrew the producer's registers.
#pragma unroll 2
            for (int k = 0; k < B_COPIES; ++k) {
                const int p = b_pixel + k * B_STEP, r = p / HALO_W, q = p % HALO_W;
                if (HALO_PIXELS % B_STEP != 0 && k == B_COPIES - 1 && p >= HALO_PIXELS) break;
                const index_t oh = oh0 + SH * r, ow = ow0 + SW * q;
                const bool ok = b_run_ok && (b_inside || (oh >= 0 && oh < H_out && ow >= 0 && ow < W_out));
                cp_async_16(stage + A_BYTES + copy_offset<B_STEP * ROW>(b_dst, k),
                            ok ? b_src + (static_cast<index_t>(SH * r) * W_out + SW * q) * COUT : grad_out, ok);
            }
            cp_async_arrive(smem_addr(&full[s]));
            j0 += TILE_W;
            if (j0 >= W) {
                j0 = 0;
                i0 += TILE_H;
                if (i0 >= H) i0 = 0, ++n;
            }
        }
        cp_async_wait<0>();
#endif
        return;
    }

    // ---------------------------------------------------------------------- consumers
    if constexpr (MOVES_REGISTERS) registers_claim<CONSUMER_REGISTERS>();
    int offsets[TAP_GROUP];   // the taps' halo origins, in registers for the descriptors
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) offsets[t] = tap_offsets[t < taps ? t : 0];
    float acc[TAP_GROUP][BN / 2];
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[t][e] = 0.0f;
    const bool signals = tid % 128 == 0;   // one arrival per consumer on the "empty" barriers
    // Each step's MMAs stay in flight while the next step waits for its tile and starts its own; the stage of
    // the step before is released once wgmma_wait<1> has retired its MMAs.  Unless SKIP_ABSENT_TAPS, no branch
    // falls between the MMAs of a step (ptxas would make each tap's first MMA wait for its registers): a block
    // of fewer taps runs its group's absent ones on its first tap's origin and never stores them.
    for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % STAGES;
        mbarrier_wait(smem_addr(&full[s]), (kt / STAGES) & 1);
        fence_async_shared();   // the tile came through cp.async (the generic proxy); wgmma reads it async
        const unsigned a_base = ring + s * STAGE_BYTES + wg * A_BLOCK;
        const unsigned b_base = ring + s * STAGE_BYTES + A_BYTES;
#pragma unroll
        for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);
        wgmma_fence();
#pragma unroll
        for (int t = 0; t < TAP_GROUP; ++t) {
            if (SKIP_ABSENT_TAPS && t >= taps) continue;
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
        if (signals && kt > 0) mbarrier_arrive(smem_addr(&empty[(kt - 1) % STAGES]));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int t = 0; t < TAP_GROUP; ++t) fence_registers(acc[t]);

    // one copy of the partials per split (grad_weight itself for SINGLE_CHUNK)
    partial_t* out = partial + static_cast<index_t>(blockIdx.z) * TAPS * CIN * COUT_G;
    store_tap_partials<TAP_GROUP, BN>(acc, taps, tap_ids, out, g, m0, n0, wg, warp, lane);
}
