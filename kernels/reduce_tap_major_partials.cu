// Second pass of grad_weight's split-K on the wgmma kernel, whose blocks write their
// partial products tap-major, partial[chunk][tap][row] with row = (ic, oc): it adds the
// chunks in order (bitwise reproducible, like reduce_partials.cu), rounds once to the
// weight's dtype and moves the taps last, out[row][tap].  A block transposes a tile of
// TAP_TILE taps x ROW_TILE rows through shared memory, so that both its reads (runs of rows)
// and its writes (runs of whole [row][tap] lines) are contiguous.
//
// The pass moves the whole weight gradient once or more (a 1024 x 512 x 4 x 4 layer's is
// 34 MB of fp32 partials a chunk), so it is bound by how many bytes each SM keeps in flight:
// rows are read VEC (4) at a time in 16-byte loads where the row count allows it, each thread
// holds LOADS of them per chunk, and CHUNKS_AT_ONCE chunks' loads are issued before any is
// added.  The tile holds every tap of a layer of up to 32 (more are split evenly over tiles),
// and as many rows as make about RUNS runs of VEC rows, so no thread waits on a tap that is
// not there.  RUNS is 1024 where that still leaves a few blocks an SM, else 256.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef {{INDEX_T}} index_t;
constexpr int TAPS = {{TAPS}};
constexpr int VEC = {{VEC}};
constexpr int CHUNKS_AT_ONCE = {{CHUNKS_AT_ONCE}};
constexpr int RUNS = {{RUNS}};
static_assert(VEC == 1 || VEC == 4, "scalar rows or 16-byte runs of four");
constexpr int THREADS = 256;
constexpr int TAP_TILES = (TAPS + 31) / 32;
constexpr int TAP_TILE = (TAPS + TAP_TILES - 1) / TAP_TILES;
constexpr int ROW_VECS = (RUNS + TAP_TILE - 1) / TAP_TILE;           // VEC-row runs a tile holds of each tap
constexpr int ROW_TILE = ROW_VECS * VEC;
constexpr int LOADS = (TAP_TILE * ROW_VECS + THREADS - 1) / THREADS;  // runs a thread loads from each chunk
// A row of the tile keeps 16-byte alignment for the vector stores into it; the spare words spread a
// column of it over the banks for the reads that transpose it.
constexpr int PITCH = ROW_TILE + VEC;

struct Rows { float v[VEC]; };

__device__ __forceinline__ Rows load_rows(const float* p) {
    Rows r;
    if constexpr (VEC == 4) {
        const float4 q = __ldg(reinterpret_cast<const float4*>(p));
        r.v[0] = q.x; r.v[1] = q.y; r.v[2] = q.z; r.v[3] = q.w;
    } else {
        r.v[0] = __ldg(p);
    }
    return r;
}

extern "C" __global__ void __launch_bounds__(THREADS)
reduce_tap_major_partials(const float* __restrict__ partial, scalar_t* __restrict__ out, index_t rows,
                          index_t chunks) {
    __shared__ __align__(16) float tile[TAP_TILE][PITCH];   // [tap][row]
    const index_t row0 = static_cast<index_t>(blockIdx.x) * ROW_TILE;
    const int tap0 = blockIdx.y * TAP_TILE;
    const int taps_here = TAPS - tap0 < TAP_TILE ? TAPS - tap0 : TAP_TILE;
    float sums[LOADS][VEC];
    bool live[LOADS];
    index_t at[LOADS];
#pragma unroll
    for (int k = 0; k < LOADS; ++k) {
        const int e = threadIdx.x + k * THREADS, t = e / ROW_VECS, r = e % ROW_VECS * VEC;
        // rows is a multiple of VEC, so a run is all in or all out.
        live[k] = e < TAP_TILE * ROW_VECS && t < taps_here && row0 + r < rows;
        at[k] = live[k] ? static_cast<index_t>(tap0 + t) * rows + row0 + r : 0;
#pragma unroll
        for (int j = 0; j < VEC; ++j) sums[k][j] = 0.0f;
    }
    const index_t chunk_stride = static_cast<index_t>(TAPS) * rows;
    for (index_t c = 0; c < chunks; c += CHUNKS_AT_ONCE) {
        // A missing chunk reads as +0.0, which leaves every sum as it is (a sum that starts at +0.0 is never -0.0).
        Rows v[CHUNKS_AT_ONCE][LOADS];
#pragma unroll
        for (int u = 0; u < CHUNKS_AT_ONCE; ++u)
#pragma unroll
            for (int k = 0; k < LOADS; ++k) {
                if (live[k] && c + u < chunks) {
                    v[u][k] = load_rows(partial + (c + u) * chunk_stride + at[k]);
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) v[u][k].v[j] = 0.0f;
                }
            }
#pragma unroll
        for (int u = 0; u < CHUNKS_AT_ONCE; ++u)
#pragma unroll
            for (int k = 0; k < LOADS; ++k)
#pragma unroll
                for (int j = 0; j < VEC; ++j) sums[k][j] += v[u][k].v[j];
    }
#pragma unroll
    for (int k = 0; k < LOADS; ++k) {
        const int e = threadIdx.x + k * THREADS, t = e / ROW_VECS, r = e % ROW_VECS * VEC;
        if (e < TAP_TILE * ROW_VECS) {
            if constexpr (VEC == 4)
                *reinterpret_cast<float4*>(&tile[t][r]) = make_float4(sums[k][0], sums[k][1], sums[k][2], sums[k][3]);
            else
                tile[t][r] = sums[k][0];
        }
    }
    __syncthreads();
    // The block's part of out is rows_here runs of taps_here values, TAPS apart; with every tap in
    // one tile it is a single contiguous run.
    const int rows_here = rows - row0 < ROW_TILE ? static_cast<int>(rows - row0) : ROW_TILE;
    if constexpr (TAP_TILES == 1) {
        for (int e = threadIdx.x; e < rows_here * TAPS; e += THREADS)
            store(out + row0 * TAPS + e, tile[e % TAPS][e / TAPS]);
    } else {
        for (int e = threadIdx.x; e < rows_here * taps_here; e += THREADS) {
            const int r = e / taps_here, t = e % taps_here;
            store(out + (row0 + r) * TAPS + tap0 + t, tile[t][r]);
        }
    }
}
