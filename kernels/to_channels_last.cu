// Copies NCHW activations into channels_last order: src[n][c][p] -> dst[n][p][c].
//
// The tensor-core GEMMs read channel runs of a pixel as 16-byte cp.async copies,
// which NCHW memory cannot give them; one bandwidth-bound pass here is cheaper
// than gathering every element of every K tile.  A 64x64 tile goes through shared
// memory so that both the reads (along p) and the writes (along c) are whole
// 128-byte rows.  Every global access is a 32-bit word: 16-bit elements move in
// pairs (two pixels in, two channels out), so a warp request is never narrower
// than the line it touches.  Each thread issues all its loads of a tile (eight words, or
// sixteen) before any lands in shared memory: a row loop that waited on each load in turn
// kept one or two in flight and moved 60% of the copy bandwidth.
// Only the bits move, so one kernel serves every dtype of a given width; with ROUND_TF32, fp32
// words are rounded to TF32 on the way (for the wgmma kernels, whose tensor cores would truncate
// them), which spares those kernels a rounding pass between a copy landing and its MMAs.
#include "tf32_round.cuh"

typedef {{INDEX_T}} index_t;

constexpr int ELEMENT_BYTES = {{ELEMENT_BYTES}};
constexpr bool ROUND_TF32 = {{ROUND_TF32}};
static_assert(!ROUND_TF32 || ELEMENT_BYTES == 4, "TF32 rounding of fp32 words");
constexpr int TILE = 64, WARPS = 8;
constexpr int ROWS = TILE / WARPS;  // tile rows a warp moves, each way
constexpr int PAIRS = ELEMENT_BYTES == 2;

template <int BYTES> struct Bits;
template <> struct Bits<2> { typedef unsigned short type; };
template <> struct Bits<4> { typedef unsigned int type; };
typedef Bits<ELEMENT_BYTES>::type bits_t;

// 16-bit: an even pitch keeps pixel pairs word-aligned (reads of channel pairs then
// meet at most 2-way bank conflicts); 32-bit: an odd pitch, conflict-free both ways.
constexpr int PITCH = PAIRS ? TILE + 2 : TILE + 1;

extern "C" __global__ void __launch_bounds__(32 * WARPS)
to_channels_last(const bits_t* __restrict__ src, bits_t* __restrict__ dst, index_t N, index_t C, index_t P) {
    __shared__ __align__(4) bits_t tile[TILE][PITCH];  // [channel][pixel]
    const int lane = threadIdx.x, warp = threadIdx.y;
    const index_t p0 = static_cast<index_t>(blockIdx.x) * TILE;
    const index_t c0 = static_cast<index_t>(blockIdx.y) * TILE;
    // Pixel pairs are word-aligned in global memory only when a channel plane has even length.
    const bool pair_loads = PAIRS && P % 2 == 0 && reinterpret_cast<unsigned long long>(src) % 4 == 0;
    const bool pair_stores = PAIRS && C % 2 == 0 && reinterpret_cast<unsigned long long>(dst) % 4 == 0;
    for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
        const bits_t* s = src + n * C * P;
        bits_t* d = dst + n * C * P;
        // Rows past C and pixels past P stage zeros, which no store below reads.
        if constexpr (PAIRS) {
            const index_t p = p0 + 2 * lane;
            unsigned words[ROWS];
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                const index_t c = c0 + warp + i * WARPS;
                words[i] = 0;
                if (c < C) {
                    const bits_t* at = s + c * P + p;
                    if (pair_loads && p + 1 < P) {
                        words[i] = __ldg(reinterpret_cast<const unsigned*>(at));
                    } else {
                        const unsigned lo = p < P ? __ldg(at) : 0, hi = p + 1 < P ? __ldg(at + 1) : 0;
                        words[i] = lo | (hi << 16);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
                *reinterpret_cast<unsigned*>(&tile[warp + i * WARPS][2 * lane]) = words[i];
        } else {
            bits_t values[ROWS][2];
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                const index_t c = c0 + warp + i * WARPS;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const index_t p = p0 + lane + 32 * h;
                    values[i][h] = c < C && p < P ? __ldg(s + c * P + p) : 0;
                }
            }
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
#pragma unroll
                for (int h = 0; h < 2; ++h) tile[warp + i * WARPS][lane + 32 * h] = values[i][h];
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const index_t p = p0 + warp + i * WARPS;
            const int r = warp + i * WARPS;
            if (p < P) {
                if constexpr (PAIRS) {
                    // Channel pairs (C is even wherever a GEMM needs this copy: whole 16-byte
                    // channel runs); otherwise element by element.
                    const index_t c = c0 + 2 * lane;
                    bits_t* out = d + p * C + c;
                    if (pair_stores && c + 1 < C) {
                        *reinterpret_cast<unsigned*>(out) =
                            tile[2 * lane][r] | (unsigned(tile[2 * lane + 1][r]) << 16);
                    } else {
                        if (c < C) out[0] = tile[2 * lane][r];
                        if (c + 1 < C) out[1] = tile[2 * lane + 1][r];
                    }
                } else {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const index_t c = c0 + lane + 32 * h;
                        if (c < C) {
                            const bits_t v = tile[lane + 32 * h][r];
                            d[p * C + c] = ROUND_TF32 ? round_tf32_bits(v) : v;
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
}
