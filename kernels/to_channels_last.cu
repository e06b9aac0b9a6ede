// Copies NCHW activations into channels_last order: src[n][c][p] -> dst[n][p][c].
//
// The tensor-core GEMMs read channel runs of a pixel as 16-byte cp.async copies,
// which NCHW memory cannot give them; one bandwidth-bound pass here is cheaper
// than gathering every element of every K tile.  A 32x32 tile goes through shared
// memory so that both the reads (along p) and the writes (along c) are coalesced.
// Only the bits move, so one kernel serves every dtype of a given width.
typedef {{INDEX_T}} index_t;

constexpr int ELEMENT_BYTES = {{ELEMENT_BYTES}};
constexpr int TILE = 32, ROWS = 8;

template <int BYTES> struct Bits;
template <> struct Bits<2> { typedef unsigned short type; };
template <> struct Bits<4> { typedef unsigned int type; };
typedef Bits<ELEMENT_BYTES>::type bits_t;

extern "C" __global__ void __launch_bounds__(TILE * ROWS)
to_channels_last(const bits_t* __restrict__ src, bits_t* __restrict__ dst, index_t N, index_t C, index_t P) {
    // Words, not bits_t, with one word of padding: column reads hit 32 distinct banks.
    __shared__ unsigned tile[TILE][TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const index_t p0 = static_cast<index_t>(blockIdx.x) * TILE;
    const index_t c0 = static_cast<index_t>(blockIdx.y) * TILE;
    for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
        const bits_t* s = src + n * C * P;
        bits_t* d = dst + n * C * P;
#pragma unroll
        for (int r = ty; r < TILE; r += ROWS) {
            const index_t c = c0 + r, p = p0 + tx;
            if (c < C && p < P) tile[r][tx] = s[c * P + p];
        }
        __syncthreads();
#pragma unroll
        for (int r = ty; r < TILE; r += ROWS) {
            const index_t p = p0 + r, c = c0 + tx;
            if (c < C && p < P) d[p * C + c] = static_cast<bits_t>(tile[tx][r]);
        }
        __syncthreads();
    }
}
