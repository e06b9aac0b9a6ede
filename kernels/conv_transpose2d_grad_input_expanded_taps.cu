// grad_input of a transposed convolution with few output channels (an RGB generator's last layer) on the
// tensor cores (mma.sync, sm_80+), one group:
//   grad_input[p][ic] = sum over columns c = tap * COUT + oc of G[p][c] * weight[ic][oc][tap]
// with G grad_out expanded by taps (tap_expanded_grad_out.cuh).  M = input pixels in tiles of TP, N = BN input
// channels (blockIdx.y), K = the expanded columns, a few k16 steps.  A block loads its channels of the weight
// once, as B, and walks pixel tiles gridDim.x apart: the threads build G's tile (A), the warps multiply, and the
// tile leaves through shared memory as whole 16-byte runs: of each pixel's channels where grad_input is
// channels_last (16-bit; K-major tiles read through ldmatrix.trans), of each channel's pixels where it is NCHW
// (16-bit or float32; tiles with K contiguous, read through ldmatrix; TF32, or strict float32 as 3xTF32, its
// sums moved into an fp32 total every 16 columns, keeping float32's accuracy).  Writing grad_input (x's size) is
// the kernel's cost; a direct kernel would spend TAPS * COUT multiply-adds of CUDA cores on each value it writes.
#include "layer.cuh"
#include "mma.cuh"
#include "tap_expanded_grad_out.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr bool NCHW = {{NCHW}};      // grad_out's and grad_input's layout
constexpr int BN = {{BN}};           // input channels of a block
constexpr int TP = {{TP}};           // input pixels of a tile

constexpr int WARPS = 4, THREADS = 32 * WARPS;   // 2 x 2 warps over the tile
constexpr int MI = TP / 32, NI = BN / 16;
constexpr int PER_WORD = 4 / sizeof(scalar_t);   // elements of a 32-bit word
constexpr int VEC = 16 / sizeof(scalar_t);       // elements of one 16-byte store
constexpr int K_WORDS = EXPANDED_PAD / PER_WORD;
// Pitches in words, 4 (mod 8): the eight rows of one ldmatrix phase (or of one fragment store) fall on disjoint
// banks.  Channels_last: B [c][ic], A [c][pixel], out [pixel][ic].  NCHW: B [ic][c], A [pixel][c], out
// [ic][pixel].
constexpr int A_PITCH = NCHW ? K_WORDS + 4 : TP / 2 + 4, B_PITCH = NCHW ? K_WORDS + 4 : BN / 2 + 4;
constexpr int OUT_PITCH = NCHW ? TP / PER_WORD + 4 : BN / 2 + 4;
constexpr int B_WORDS = (NCHW ? BN : EXPANDED_PAD) * B_PITCH, A_WORDS = (NCHW ? TP : EXPANDED_PAD) * A_PITCH;
// An NCHW tile leaves as one 16-byte run of pixels of each of a thread's channel rows, the same run in all.
constexpr int RUNS_ACROSS = TP / VEC, ROW_STEP = THREADS / RUNS_ACROSS;
static_assert(NCHW || sizeof(scalar_t) == 2, "channels_last tiles hold 16-bit values (ldmatrix.trans)");
static_assert(TP % 32 == 0 && BN % 16 == 0, "whole mma tiles, B fragments two n8 tiles at a time");
static_assert(!NCHW || (THREADS % RUNS_ACROSS == 0 && BN % ROW_STEP == 0), "whole rows of runs a thread");

extern "C" __global__ void __launch_bounds__(THREADS)
conv_transpose2d_grad_input_expanded_taps(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ weight,
                                          scalar_t* __restrict__ grad_in, index_t pixels, index_t H, index_t W,
                                          index_t H_out, index_t W_out) {
    extern __shared__ __align__(16) unsigned smem[];
    unsigned* b_tile = smem;
    unsigned* a_tile = smem + B_WORDS;
    unsigned* out_tile = a_tile + A_WORDS;
    raw_t* b_raw = reinterpret_cast<raw_t*>(b_tile);
    raw_t* a_raw = reinterpret_cast<raw_t*>(a_tile);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_row = (warp % 2) * (TP / 2), warp_col = (warp / 2) * (BN / 2);
    const int ic0 = blockIdx.y * BN;

    // The weight's columns for this block's channels, and zeros where K is padded (in both operands, so that
    // no stale shared memory meets a zero).
    const raw_t* w_raw = reinterpret_cast<const raw_t*>(weight);
    for (int e = threadIdx.x; e < EXPANDED_PAD * BN; e += THREADS) {
        const int c = NCHW ? e % EXPANDED_PAD : e / BN, n = NCHW ? e / EXPANDED_PAD : e % BN, ic = ic0 + n;
        const raw_t value = c < EXPANDED && ic < CIN ? __ldg(w_raw + weight_index(ic, c % COUT, c / COUT))
                                                     : static_cast<raw_t>(0);
        b_raw[NCHW ? n * (PER_WORD * B_PITCH) + c : c * (PER_WORD * B_PITCH) + n] = value;
    }
    for (int e = threadIdx.x; e < (EXPANDED_PAD - EXPANDED) * TP; e += THREADS) {
        const int c = EXPANDED + e / TP, q = e % TP;
        a_raw[NCHW ? q * (PER_WORD * A_PITCH) + c : c * (PER_WORD * A_PITCH) + q] = 0;
    }

    const index_t tiles = (pixels + TP - 1) / TP;
    // G's next tile is loaded into registers before this tile's MMAs and stored after them.
    ExpandedTapsRuns<TP, THREADS, NCHW> runs;
    if (blockIdx.x < tiles) runs.load(grad_out, static_cast<index_t>(blockIdx.x) * TP, pixels, H, W, H_out, W_out);
    for (index_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const index_t p0 = tile * TP;
        runs.store([&](int q, int c, raw_t bits) {
            a_raw[NCHW ? q * (PER_WORD * A_PITCH) + c : c * (PER_WORD * A_PITCH) + q] = bits;
        });
        __syncthreads();   // G's tile is whole; the last tile's stores have left out_tile
        if (tile + gridDim.x < tiles) runs.load(grad_out, (tile + gridDim.x) * TP, pixels, H, W, H_out, W_out);

        float acc[MI][NI][4], total[MI][NI][4];
        zero(acc);
        zero(total);
        if constexpr (KIND == MMA_3XTF32) {
#pragma unroll
            for (int part = 0; part < K_WORDS / TILE_K_WORDS; ++part) {
                warp_tile_mma<KIND, MI, NI, 0, A_PITCH, B_PITCH>(acc, a_tile + part * TILE_K_WORDS,
                                                                 b_tile + part * TILE_K_WORDS, warp_row, warp_col,
                                                                 lane);
                promote(total, acc);
            }
        } else if constexpr (NCHW)
            warp_tile_mma<KIND, MI, NI, 0, A_PITCH, B_PITCH, K_WORDS / KSTEP_WORDS>(acc, a_tile, b_tile, warp_row,
                                                                                  warp_col, lane);
        else
            warp_tile_mma_kmajor<KIND, MI, NI, A_PITCH, B_PITCH, EXPANDED_PAD / 16>(acc, a_tile, b_tile, warp_row,
                                                                                  warp_col, lane);
        // Fragment (mi, ni, r): pixel warp_row + mi*16 + lane/4 (+8 for r >= 2), channel warp_col + ni*8 +
        // 2*(lane%4) (+1 for odd r).
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int q = warp_row + mi * 16 + lane / 4 + h * 8, n = warp_col + ni * 8 + 2 * (lane % 4);
                    const float* v = pick_result<KIND>(acc, total)[mi][ni];
                    if constexpr (NCHW) {
                        scalar_t* out = reinterpret_cast<scalar_t*>(out_tile);
                        store(out + n * (PER_WORD * OUT_PITCH) + q, v[2 * h]);
                        store(out + (n + 1) * (PER_WORD * OUT_PITCH) + q, v[2 * h + 1]);
                    } else {
                        out_tile[q * OUT_PITCH + n / 2] = pack_pair<scalar_t>(v[2 * h], v[2 * h + 1]);
                    }
                }
        __syncthreads();   // the tile is in out_tile; every warp is done reading G's tile

        if constexpr (NCHW) {
            // A run of VEC pixels lies in one image: the planner takes H * W in whole runs.
            const int v = threadIdx.x % RUNS_ACROSS;
            const index_t p = p0 + v * VEC, plane = H * W;
            scalar_t* run = grad_in + (p / plane) * CIN * plane + p % plane;
            if (p < pixels) {
#pragma unroll
                for (int n = threadIdx.x / RUNS_ACROSS; n < BN; n += ROW_STEP)
                    if (ic0 + n < CIN)
                        *reinterpret_cast<uint4*>(run + (ic0 + n) * plane) =
                            *reinterpret_cast<const uint4*>(out_tile + n * OUT_PITCH + v * 4);
            }
        } else {
            for (int e = threadIdx.x; e < TP * (BN / VEC); e += THREADS) {
                const int q = e / (BN / VEC), v = e % (BN / VEC);
                if (p0 + q < pixels && ic0 + v * VEC < CIN)
                    *reinterpret_cast<uint4*>(grad_in + (p0 + q) * CIN + ic0 + v * VEC) =
                        *reinterpret_cast<const uint4*>(out_tile + q * OUT_PITCH + v * (VEC / 2));
            }
        }
    }
}
