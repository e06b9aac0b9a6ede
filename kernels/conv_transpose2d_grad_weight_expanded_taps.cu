// grad_weight of a transposed convolution with few output channels (an RGB generator's last layer) on the
// tensor cores (mma.sync, sm_80+), one group:
//   grad_weight[ic][oc][tap] = sum over input pixels p of x[p][ic] * G[p][tap * COUT + oc]
// with G grad_out expanded by taps (tap_expanded_grad_out.cuh).  M = input channels (BM a block, blockIdx.y),
// N = every (tap, output channel) column, K = the input pixels in tiles of TP.  The x tile is A, landing by
// cp.async; G's tile is B, built by the threads from grad_out, which is small beside x (its loads a step ahead,
// in registers).  Channels_last (16-bit): both are [pixel][...] tiles, x's rows as they lie in memory, read
// through ldmatrix.trans.  NCHW (16-bit or float32): both are [...][pixel] tiles, each of x's channels a run of
// pixels as it lies in memory, read through ldmatrix, whose 16-bit halves of an fp32 word land where the TF32
// fragment wants them; strict float32 runs as 3xTF32, its sums moved into an fp32 total every 16 pixels, so it keeps
// float32's accuracy.  x is read once in all, so the kernel runs at the speed of streaming it, where a direct
// kernel would spend TAPS * COUT multiply-adds of CUDA cores on each of its values.
// blockIdx.x takes a fixed range of K tiles and writes its partial sums in the weight's own layout;
// reduce_partials.cu adds the ranges in order, so the result is bitwise reproducible.  A single range writes
// grad_weight itself.
#include "layer.cuh"
#include "mma.cuh"
#include "cp_async_pipeline.cuh"
#include "tap_expanded_grad_out.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr bool NCHW = {{NCHW}};      // x's and grad_out's layout
constexpr int BM = {{BM}};           // input channels of a block, 16 * MI to each of the four warps
constexpr int TP = {{TP}};           // input pixels of a K tile
constexpr int STAGES = {{STAGES}};
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
typedef PartialOut<SINGLE_CHUNK, scalar_t, float>::type partial_t;

constexpr int WARPS = 4, THREADS = 32 * WARPS;
constexpr int MI = BM / (16 * WARPS), NI = EXPANDED_PAD / 8;
constexpr int PER_WORD = 4 / sizeof(scalar_t);                // elements of a 32-bit word
constexpr int VEC = 16 / sizeof(scalar_t);                    // elements of one 16-byte copy
constexpr int TP_WORDS = TP / PER_WORD;
// Pitches in words, 4 (mod 8): the eight rows of one ldmatrix phase fall on disjoint banks.
constexpr int A_PITCH = NCHW ? TP_WORDS + 4 : BM / 2 + 4, B_PITCH = NCHW ? TP_WORDS + 4 : EXPANDED_PAD / 2 + 4;
constexpr int A_WORDS = (NCHW ? BM : TP) * A_PITCH, STAGE_WORDS = A_WORDS + (NCHW ? EXPANDED_PAD : TP) * B_PITCH;
// An NCHW x tile: a thread copies one 16-byte run of each of its channel rows, the same run of pixels in all.
constexpr int RUNS_ACROSS = TP / VEC, ROW_STEP = THREADS / RUNS_ACROSS;
static_assert(NCHW || sizeof(scalar_t) == 2, "channels_last tiles hold 16-bit values (ldmatrix.trans)");
static_assert(BM % (16 * WARPS) == 0 && TP % 16 == 0 && TP_WORDS % TILE_K_WORDS == 0, "whole mma tiles");
static_assert(!NCHW || (THREADS % RUNS_ACROSS == 0 && BM % ROW_STEP == 0), "whole rows of runs a thread");
static_assert(STAGES >= 3, "G's tiles are stored a step after their loads, into a buffer two steps old");

extern "C" __global__ void __launch_bounds__(THREADS)
conv_transpose2d_grad_weight_expanded_taps(const scalar_t* __restrict__ x, const scalar_t* __restrict__ grad_out,
                                           partial_t* __restrict__ partial, index_t pixels, index_t H, index_t W,
                                           index_t H_out, index_t W_out, index_t tiles_per_chunk) {
    extern __shared__ __align__(16) unsigned smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int ic0 = blockIdx.y * BM;
    const index_t tiles = (pixels + TP - 1) / TP;
    const index_t first = static_cast<index_t>(blockIdx.x) * tiles_per_chunk;
    const index_t last = first + tiles_per_chunk < tiles ? first + tiles_per_chunk : tiles;
    const int k_tiles = last > first ? static_cast<int>(last - first) : 0;

    float acc[MI][NI][4], total[MI][NI][4];
    zero(acc);
    zero(total);
    ExpandedTapsRuns<TP, THREADS, NCHW> runs;
    auto copy_x = [&](int kt) {
        unsigned* stage = smem + kt % STAGES * STAGE_WORDS;
        const index_t p0 = (first + kt) * TP;
        if constexpr (NCHW) {
            // A run of VEC pixels lies in one image: the planner takes H * W in whole runs.
            const int v = threadIdx.x % RUNS_ACROSS;
            const index_t p = p0 + v * VEC, plane = H * W;
            const scalar_t* run = x + (p / plane) * CIN * plane + p % plane;
#pragma unroll
            for (int row = threadIdx.x / RUNS_ACROSS; row < BM; row += ROW_STEP) {
                const bool ok = p < pixels && ic0 + row < CIN;
                cp_async_16(smem_addr(stage + row * A_PITCH + v * 4), ok ? run + (ic0 + row) * plane : x, ok);
            }
        } else {
            for (int e = threadIdx.x; e < TP * (BM / VEC); e += THREADS) {
                const int q = e / (BM / VEC), v = e % (BM / VEC);
                const bool ok = p0 + q < pixels && ic0 + v * VEC < CIN;
                const scalar_t* src = ok ? x + (p0 + q) * CIN + ic0 + v * VEC : x;
                cp_async_16(smem_addr(stage + q * A_PITCH + v * 4), src, ok);
            }
        }
    };
    auto load_g = [&](int kt) { runs.load(grad_out, (first + kt) * TP, pixels, H, W, H_out, W_out); };
    auto store_g = [&](int kt) {
        raw_t* b = reinterpret_cast<raw_t*>(smem + kt % STAGES * STAGE_WORDS + A_WORDS);
        runs.store([&](int q, int c, raw_t bits) {
            if constexpr (NCHW) b[c * (PER_WORD * B_PITCH) + q] = bits;
            else b[q * (PER_WORD * B_PITCH) + c] = bits;
        });
    };

    // The x tiles go STAGES - 1 ahead by cp.async.  G's tile kt + STAGES - 1 is loaded into registers in step kt,
    // before its MMAs, and stored in step kt + 1, once the loads have had a whole step to land; it is read in step
    // kt + STAGES - 1, after two more barriers.
#pragma unroll
    for (int kt = 0; kt < STAGES - 1; ++kt) {
        if (kt < k_tiles) {
            copy_x(kt);
            load_g(kt);
            if (kt < STAGES - 2) store_g(kt);
        }
        cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        // x's tile kt has landed and G's was stored two barriers ago; every warp is done with tile kt - 1, whose
        // buffer x's tile kt + STAGES - 1 takes, and with tile kt - 2, whose buffer G's tile kt + STAGES - 2 takes.
        __syncthreads();
        const int ahead = kt + STAGES - 1;
        if (ahead - 1 < k_tiles) store_g(ahead - 1);
        if (ahead < k_tiles) {
            copy_x(ahead);
            load_g(ahead);
        }
        cp_async_commit();
        const unsigned* stage = smem + kt % STAGES * STAGE_WORDS;
        if constexpr (KIND == MMA_3XTF32) {
#pragma unroll
            for (int part = 0; part < TP_WORDS / TILE_K_WORDS; ++part) {
                warp_tile_mma<KIND, MI, NI, 0, A_PITCH, B_PITCH>(acc, stage + part * TILE_K_WORDS,
                                                                 stage + A_WORDS + part * TILE_K_WORDS,
                                                                 warp * 16 * MI, 0, lane);
                promote(total, acc);
            }
        } else if constexpr (NCHW)
            warp_tile_mma<KIND, MI, NI, 0, A_PITCH, B_PITCH, TP_WORDS / KSTEP_WORDS>(acc, stage, stage + A_WORDS,
                                                                                    warp * 16 * MI, 0, lane);
        else
            warp_tile_mma_kmajor<KIND, MI, NI, A_PITCH, B_PITCH, TP / 16>(acc, stage, stage + A_WORDS,
                                                                          warp * 16 * MI, 0, lane);
    }
    cp_async_wait<0>();

    // Fragment (mi, ni, r) holds row warp*16*MI + mi*16 + lane/4 (+8 for r >= 2), column ni*8 + 2*(lane%4) + r%2.
    partial_t* out = partial + (SINGLE_CHUNK ? 0 : static_cast<index_t>(blockIdx.x) * CIN * COUT * TAPS);
    const auto& result = pick_result<KIND>(acc, total);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int ic = ic0 + warp * 16 * MI + mi * 16 + lane / 4 + (r / 2) * 8;
                const int c = ni * 8 + 2 * (lane % 4) + r % 2;
                if (ic < CIN && c < EXPANDED) store(out + weight_index(ic, c % COUT, c / COUT), result[mi][ni][r]);
            }
}
