// Second pass of grad_weight's split-K on the wgmma kernel, whose blocks write their
// partial products tap-major, partial[chunk][tap][row] with row = (ic, oc): it adds the
// chunks in order (bitwise reproducible, like reduce_partials.cu), rounds once to the
// weight's dtype and moves the taps last, out[row][tap].  A block transposes a tile of
// 32 rows x 32 taps through shared memory, so that both its reads (runs of rows) and its
// writes (runs of whole [row][tap] lines) are contiguous.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef {{INDEX_T}} index_t;
constexpr int TAPS = {{TAPS}};
constexpr int TILE = 32, ROWS_AT_ONCE = 8;   // a block is 32 x 8 threads

extern "C" __global__ void __launch_bounds__(TILE * ROWS_AT_ONCE)
reduce_tap_major_partials(const float* __restrict__ partial, scalar_t* __restrict__ out, index_t rows,
                          index_t chunks) {
    __shared__ float tile[TILE][TILE + 1];   // [tap][row]; the spare column spreads a column over the banks
    const index_t row0 = static_cast<index_t>(blockIdx.x) * TILE;
    const int tap0 = blockIdx.y * TILE;
    const int lane = threadIdx.x % TILE, sub = threadIdx.x / TILE;
    const index_t row = row0 + lane;
#pragma unroll
    for (int t = sub; t < TILE; t += ROWS_AT_ONCE) {
        const int tap = tap0 + t;
        float s = 0.0f;
        if (tap < TAPS && row < rows)
            for (index_t c = 0; c < chunks; ++c) s += partial[(c * TAPS + tap) * rows + row];
        tile[t][lane] = s;
    }
    __syncthreads();
    // The block's part of out is rows_here runs of taps_here values, TAPS apart; with every tap in
    // one tile (TAPS <= 32) it is a single contiguous run.
    const int taps_here = TAPS - tap0 < TILE ? TAPS - tap0 : TILE;
    const int rows_here = rows - row0 < TILE ? static_cast<int>(rows - row0) : TILE;
    for (int e = threadIdx.x; e < rows_here * taps_here; e += TILE * ROWS_AT_ONCE) {
        const int r = e / taps_here, t = e % taps_here;
        store(out + (row0 + r) * TAPS + tap0 + t, tile[t][r]);
    }
}
