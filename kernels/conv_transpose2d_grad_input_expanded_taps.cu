// grad_input of a transposed convolution with few output channels (an RGB generator's last layer) on the
// tensor cores (mma.sync, sm_80+), channels_last, one group:
//   grad_input[p][ic] = sum over columns c = tap * COUT + oc of G[p][c] * weight[ic][oc][tap]
// with G grad_out expanded by taps (tap_expanded_grad_out.cuh).  M = input pixels in tiles of TP, N = BN input
// channels (blockIdx.y), K = the expanded columns, a few k16 steps.  A block loads its channels of the weight
// once, as B ([c][ic]), and walks pixel tiles gridDim.x apart: the threads build G's tile transposed
// ([c][pixel], A), the warps multiply, and the tile leaves through shared memory as whole 16-byte runs of each
// pixel's channels.  Writing grad_input (x's size) is the kernel's cost; a direct kernel would spend
// TAPS * COUT multiply-adds of CUDA cores on each value it writes.
#include "layer.cuh"
#include "mma.cuh"
#include "tap_expanded_grad_out.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int BN = {{BN}};           // input channels of a block
constexpr int TP = {{TP}};           // input pixels of a tile

constexpr int WARPS = 4, THREADS = 32 * WARPS;   // 2 x 2 warps over the tile
constexpr int MI = TP / 32, NI = BN / 16;
constexpr int VEC = 8;                           // 16-bit channels in one 16-byte store
// Pitches in words, 4 (mod 8): the eight rows of one ldmatrix phase (or of one fragment store) fall on disjoint
// banks.
constexpr int A_PITCH = TP / 2 + 4, B_PITCH = BN / 2 + 4, OUT_PITCH = BN / 2 + 4;
constexpr int B_WORDS = EXPANDED_PAD * B_PITCH, A_WORDS = EXPANDED_PAD * A_PITCH;
static_assert(TP % 32 == 0 && BN % 16 == 0, "whole mma tiles, B fragments two n8 tiles at a time");

extern "C" __global__ void __launch_bounds__(THREADS)
conv_transpose2d_grad_input_expanded_taps(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ weight,
                                          scalar_t* __restrict__ grad_in, index_t pixels, index_t H, index_t W,
                                          index_t H_out, index_t W_out) {
    extern __shared__ __align__(16) unsigned smem[];
    unsigned* b_tile = smem;
    unsigned* a_tile = smem + B_WORDS;
    unsigned* out_tile = a_tile + A_WORDS;
    unsigned short* b16 = reinterpret_cast<unsigned short*>(b_tile);
    unsigned short* a16 = reinterpret_cast<unsigned short*>(a_tile);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_row = (warp % 2) * (TP / 2), warp_col = (warp / 2) * (BN / 2);
    const int ic0 = blockIdx.y * BN;

    // The weight's columns for this block's channels, and zeros where K is padded (in both operands, so that
    // no stale shared memory meets a zero).
    const unsigned short* w16 = reinterpret_cast<const unsigned short*>(weight);
    for (int e = threadIdx.x; e < EXPANDED_PAD * BN; e += THREADS) {
        const int c = e / BN, ic = ic0 + e % BN;
        b16[c * (2 * B_PITCH) + e % BN] = c < EXPANDED && ic < CIN ? __ldg(w16 + weight_index(ic, c % COUT, c / COUT))
                                                                   : static_cast<unsigned short>(0);
    }
    for (int e = threadIdx.x; e < (EXPANDED_PAD - EXPANDED) * TP; e += THREADS)
        a16[(EXPANDED + e / TP) * (2 * A_PITCH) + e % TP] = 0;

    const index_t tiles = (pixels + TP - 1) / TP;
    // G's next tile is loaded into registers before this tile's MMAs and stored after them.
    ExpandedTapsRuns<TP, THREADS> runs;
    if (blockIdx.x < tiles) runs.load(grad_out, static_cast<index_t>(blockIdx.x) * TP, pixels, H, W, H_out, W_out);
    for (index_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const index_t p0 = tile * TP;
        runs.store([&](int q, int c, unsigned short bits) { a16[c * (2 * A_PITCH) + q] = bits; });
        __syncthreads();   // G's tile is whole; the last tile's stores have left out_tile
        if (tile + gridDim.x < tiles) runs.load(grad_out, (tile + gridDim.x) * TP, pixels, H, W, H_out, W_out);

        float acc[MI][NI][4];
        zero(acc);
        warp_tile_mma_kmajor<KIND, MI, NI, A_PITCH, B_PITCH, EXPANDED_PAD / 16>(acc, a_tile, b_tile, warp_row,
                                                                              warp_col, lane);
        // Fragment (mi, ni, r): pixel warp_row + mi*16 + lane/4 (+8 for r >= 2), channels warp_col + ni*8 +
        // 2*(lane%4) and the next, one word.
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int q = warp_row + mi * 16 + lane / 4 + h * 8, n = warp_col + ni * 8 + 2 * (lane % 4);
                    out_tile[q * OUT_PITCH + n / 2] = pack_pair<scalar_t>(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
                }
        __syncthreads();   // the tile is in out_tile; every warp is done reading G's tile

        for (int e = threadIdx.x; e < TP * (BN / VEC); e += THREADS) {
            const int q = e / (BN / VEC), v = e % (BN / VEC);
            if (p0 + q < pixels && ic0 + v * VEC < CIN)
                *reinterpret_cast<uint4*>(grad_in + (p0 + q) * CIN + ic0 + v * VEC) =
                    *reinterpret_cast<const uint4*>(out_tile + q * OUT_PITCH + v * (VEC / 2));
        }
    }
}
