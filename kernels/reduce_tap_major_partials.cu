// Second pass of grad_weight's split-K on the wgmma kernel, whose blocks write their
// partial products tap-major, partial[chunk][tap][row] with row = (ic, oc): it adds the
// chunks in order (bitwise reproducible, like reduce_partials.cu), rounds once to the
// weight's dtype and moves the taps last, out[row][tap].  A block transposes a tile of
// TAP_TILE taps x ROW_TILE rows, 1024 values, through shared memory, so that both its reads
// (runs of rows) and its writes (runs of whole [row][tap] lines) are contiguous.  The tile is
// as tall as the layer's taps need (up to 32), so that every thread loads: with 32-tap tiles,
// a 4-tap layer left seven threads in eight idle.  Loads of CHUNKS_AT_ONCE chunks are in flight
// together before they are added in order: a layer with many chunks and few rows is bound by
// how many loads wait at once.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef {{INDEX_T}} index_t;
constexpr int TAPS = {{TAPS}};
__host__ __device__ constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }
constexpr int TAP_TILE = TAPS < 32 ? pow2_at_least(TAPS) : 32;
constexpr int TILE_VALUES = 1024, ROW_TILE = TILE_VALUES / TAP_TILE, THREADS = 256, PER_THREAD = TILE_VALUES / THREADS;
constexpr int CHUNKS_AT_ONCE = 4;

extern "C" __global__ void __launch_bounds__(THREADS)
reduce_tap_major_partials(const float* __restrict__ partial, scalar_t* __restrict__ out, index_t rows,
                          index_t chunks) {
    __shared__ float tile[TAP_TILE][ROW_TILE + 1];   // [tap][row]; the spare column spreads a column over the banks
    const index_t row0 = static_cast<index_t>(blockIdx.x) * ROW_TILE;
    const int tap0 = blockIdx.y * TAP_TILE;
    float sums[PER_THREAD];
    bool live[PER_THREAD];
    index_t at[PER_THREAD];
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) {
        const int e = threadIdx.x + k * THREADS, t = e / ROW_TILE, r = e % ROW_TILE;
        live[k] = tap0 + t < TAPS && row0 + r < rows;
        at[k] = live[k] ? static_cast<index_t>(tap0 + t) * rows + row0 + r : 0;
        sums[k] = 0.0f;
    }
    const index_t chunk_stride = static_cast<index_t>(TAPS) * rows;
    for (index_t c = 0; c < chunks; c += CHUNKS_AT_ONCE) {
        // A missing chunk reads as +0.0, which leaves every sum as it is (a sum that starts at +0.0 is never -0.0).
        float v[CHUNKS_AT_ONCE][PER_THREAD];
#pragma unroll
        for (int u = 0; u < CHUNKS_AT_ONCE; ++u)
#pragma unroll
            for (int k = 0; k < PER_THREAD; ++k)
                v[u][k] = live[k] && c + u < chunks ? partial[(c + u) * chunk_stride + at[k]] : 0.0f;
#pragma unroll
        for (int u = 0; u < CHUNKS_AT_ONCE; ++u)
#pragma unroll
            for (int k = 0; k < PER_THREAD; ++k) sums[k] += v[u][k];
    }
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) {
        const int e = threadIdx.x + k * THREADS;
        tile[e / ROW_TILE][e % ROW_TILE] = sums[k];
    }
    __syncthreads();
    // The block's part of out is rows_here runs of taps_here values, TAPS apart; with every tap in
    // one tile (TAPS <= 32) it is a single contiguous run.
    const int taps_here = TAPS - tap0 < TAP_TILE ? TAPS - tap0 : TAP_TILE;
    const int rows_here = rows - row0 < ROW_TILE ? static_cast<int>(rows - row0) : ROW_TILE;
    for (int e = threadIdx.x; e < rows_here * taps_here; e += THREADS) {
        const int r = e / taps_here, t = e % taps_here;
        store(out + (row0 + r) * TAPS + tap0 + t, tile[t][r]);
    }
}
