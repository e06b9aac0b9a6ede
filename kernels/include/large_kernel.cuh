// The large-kernel family's shared pieces.  Its kernels run any kernel size: tap loops
// are run-time loops, and weights pass through shared memory one fixed-size tile of taps
// at a time, so neither registers nor shared memory grow with KH or KW.  The forward (one
// stride phase per block) and grad_input are the same gather along different axes.
// Include after layer.cuh.
#pragma once

template <typename T> __device__ __forceinline__ T min_of(T a, T b) { return a < b ? a : b; }
template <typename T> __device__ __forceinline__ T max_of(T a, T b) { return a > b ? a : b; }

// floor(a / b) and ceil(a / b) for b > 0 and a of either sign: C++ division truncates.
__device__ __forceinline__ index_t floor_div(index_t a, index_t b) { return a >= 0 ? a / b : -((b - 1 - a) / b); }
__device__ __forceinline__ index_t ceil_div(index_t a, index_t b) { return a >= 0 ? (a + b - 1) / b : -(-a / b); }

// gcd(A, B) at compile time (NVRTC takes no host functions, constexpr ones included).
template <int A, int B> struct Gcd { static constexpr int value = Gcd<B, A % B>::value; };
template <int A> struct Gcd<A, 0> { static constexpr int value = A; };

// One axis of a gather.  Cell v (0 <= v < count) is written at dst0 + v * DST_STEP; its
// tap j (0 <= j < taps) reads the source at src0 + v * SRC_STEP + j * TAP_STEP when that
// lies in [0, size), with the weights of kernel index k0 + j * K_STEP.
template <int DST_STEP, int SRC_STEP, int TAP_STEP, int K_STEP>
struct Axis {
    static_assert(TAP_STEP != 0, "consecutive taps read different source positions");
    static_assert(SRC_STEP > 0, "consecutive cells read later source positions");
    static constexpr int SOURCE_STEP = SRC_STEP;  // between the sources of consecutive cells
    index_t count, dst0, src0, size;
    int k0, taps;

    __device__ __forceinline__ index_t dst(index_t v) const { return dst0 + v * DST_STEP; }
    __device__ __forceinline__ index_t src(index_t v, int j) const {
        return src0 + v * SRC_STEP + static_cast<index_t>(j) * TAP_STEP;
    }
    __device__ __forceinline__ int kernel_index(int j) const { return k0 + j * K_STEP; }

    // [lo, hi): the taps of cell v whose source lies inside, empty when lo >= hi.
    __device__ __forceinline__ void taps_of(index_t v, int& lo, int& hi) const {
        const index_t base = src0 + v * SRC_STEP;
        index_t first, end;
        if constexpr (TAP_STEP > 0) {
            first = ceil_div(-base, TAP_STEP);
            end = floor_div(size - 1 - base, TAP_STEP) + 1;
        } else {
            first = ceil_div(base - (size - 1), -TAP_STEP);
            end = floor_div(base, -TAP_STEP) + 1;
        }
        lo = clamp(first);
        hi = clamp(end);
    }

    // Both ends of a cell's taps move monotonically with v, so the taps of cells a..b
    // (inclusive) lie within those of the two end cells.
    __device__ __forceinline__ void taps_of(index_t a, index_t b, int& lo, int& hi) const {
        int lo_a, hi_a, lo_b, hi_b;
        taps_of(a, lo_a, hi_a);
        taps_of(b, lo_b, hi_b);
        lo = min_of(lo_a, lo_b);
        hi = max_of(hi_a, hi_b);
    }

    __device__ __forceinline__ int clamp(index_t j) const {
        return j < 0 ? 0 : j > taps ? taps : static_cast<int>(j);
    }

    // [lo, hi): the cells c < cells, counted from one whose source is at r, whose source
    // r + c * SRC_STEP lies in [0, size).
    __device__ __forceinline__ void inside(index_t r, index_t size, int cells, int& lo, int& hi) const {
        const index_t first = r >= 0 ? 0 : ceil_div(-r, SRC_STEP);
        const index_t end = r < size ? floor_div(size - 1 - r, SRC_STEP) + 1 : 0;
        lo = static_cast<int>(min_of(first, static_cast<index_t>(cells)));
        hi = static_cast<int>(min_of(end, static_cast<index_t>(cells)));
    }
};

// dst = gather of src through the weights, for one block.  P describes the pass:
//   CHANNELS_LAST, the tiling (LANES x RUNS threads, lane fastest; a lane owns OCB adjacent
//   destination channels, a run CELLS cells of one column, and a block's runs form a patch
//   of TILE_W columns; TJ x TI taps and SRC_CHUNK source channels of weights are staged at
//   a time), the channel counts (DST_CH, DST_G, SRC_CH, SRC_G: destination channel d reads
//   the source channels of its group, d / DST_G), the axes AxisH and AxisW, and
//   weight(d, s, kh, kw), the weight of destination channel d and source channel s of its group.
// In NCHW LANES is 1 and a block's OCB channels lie in one group, so threads run along
// pixels; in channels_last they run along channels and a block's channels may span groups.
// bias(d) starts each destination channel's sum.
template <class P, typename Bias>
__device__ __forceinline__ void gather(const scalar_t* __restrict__ src, const scalar_t* __restrict__ w,
                                       scalar_t* __restrict__ dst, const typename P::AxisH& ah,
                                       const typename P::AxisW& aw, index_t N, index_t dst_h, index_t dst_w,
                                       index_t tile_h, index_t tile_w, Bias&& bias) {
    constexpr int OCB = P::OCB, CELLS = P::CELLS, TJ = P::TJ, TI = P::TI, SRC_CHUNK = P::SRC_CHUNK;
    constexpr int OC_TILE = P::LANES * OCB;
    constexpr int THREADS = P::LANES * P::RUNS;
    constexpr int TILE_H = P::RUNS / P::TILE_W;  // runs along h
    constexpr int ROWS = TILE_H * CELLS;         // cells along h of a block
    constexpr int STAGED = SRC_CHUNK * TJ * TI * OC_TILE;
    constexpr int DST_TILES = P::CHANNELS_LAST ? (P::DST_CH + OC_TILE - 1) / OC_TILE
                                               : GROUPS * ((P::DST_G + OCB - 1) / OCB);
    // Elements between neighbouring pixels of the source plane and of the destination plane.
    constexpr index_t SRC_PITCH = P::CHANNELS_LAST ? P::SRC_CH : 1;
    constexpr index_t DST_PITCH = P::CHANNELS_LAST ? P::DST_CH : 1;
    __shared__ __align__(16) acc_t ws[STAGED];

    const index_t bh0 = tile_h * ROWS, bw0 = tile_w * P::TILE_W;
    const index_t bh1 = min_of(bh0 + ROWS, ah.count), bw1 = min_of(bw0 + P::TILE_W, aw.count);
    if (bh0 >= bh1 || bw0 >= bw1) return;  // the whole block: no __syncthreads is left waiting
    // Only tap tiles that some cell of the block reads are staged.
    int block_j0, block_j1, block_i0, block_i1;
    ah.taps_of(bh0, bh1 - 1, block_j0, block_j1);
    aw.taps_of(bw0, bw1 - 1, block_i0, block_i1);

    const int lane = threadIdx.x % P::LANES, run = threadIdx.x / P::LANES;
    const index_t vh = bh0 + (run / P::TILE_W) * CELLS, vw = bw0 + run % P::TILE_W;
    // Threads with no cells stay to help stage weights.
    const bool has_cells = run / P::TILE_W < TILE_H && vh < ah.count && vw < aw.count;
    int my_j0 = 0, my_j1 = 0, my_i0 = 0, my_i1 = 0;
    if (has_cells) {
        ah.taps_of(vh, min_of(vh + CELLS, ah.count) - 1, my_j0, my_j1);
        aw.taps_of(vw, my_i0, my_i1);
    }
    const index_t src_h = ah.size, src_w = aw.size;
    const int cells = has_cells ? static_cast<int>(min_of(static_cast<index_t>(CELLS), ah.count - vh)) : 0;
    // Source offsets between rows, and between the rows of consecutive cells.
    const index_t row_pitch = src_w * SRC_PITCH, cell_pitch = P::AxisH::SOURCE_STEP * row_pitch;

    for (int tile = blockIdx.y; tile < DST_TILES; tile += gridDim.y) {
        // The tile's channels are first .. limit - 1 (the rest of a group, in NCHW).
        int first, limit;
        if constexpr (P::CHANNELS_LAST) {
            first = tile * OC_TILE;
            limit = P::DST_CH;
        } else {
            constexpr int BLOCKS = (P::DST_G + OCB - 1) / OCB;
            first = tile / BLOCKS * P::DST_G + tile % BLOCKS * OCB;
            limit = (tile / BLOCKS + 1) * P::DST_G;
        }
        const int d = first + lane * OCB;  // the thread's first channel
        const bool active = has_cells && d < limit;
        const int g = (d < limit ? d : first) / P::DST_G;

        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[CELLS][OCB];
#pragma unroll
            for (int o = 0; o < OCB; ++o) {
                const acc_t b = active && d + o < limit ? bias(d + o) : acc_t(0);
#pragma unroll
                for (int c = 0; c < CELLS; ++c) acc[c][o] = b;
            }

#pragma unroll 1
            for (int jt = block_j0; jt < block_j1; jt += TJ)
#pragma unroll 1
                for (int it = block_i0; it < block_i1; it += TI)
#pragma unroll 1
                    for (int s0 = 0; s0 < P::SRC_G; s0 += SRC_CHUNK) {
                        const int jn = min_of(TJ, block_j1 - jt), in = min_of(TI, block_i1 - it);
                        const int sn = min_of(SRC_CHUNK, P::SRC_G - s0);
                        __syncthreads();  // every thread is done with the previous tile
                        // ws[sc][jj][ii][t]: kernel columns fastest in the loop, so that
                        // neighbouring threads read neighbouring weights.
                        for (int e = threadIdx.x; e < STAGED; e += THREADS) {
                            const int ii = e % TI, t = e / TI % OC_TILE, jj = e / (TI * OC_TILE) % TJ;
                            const int sc = e / (TI * OC_TILE * TJ);
                            acc_t v = acc_t(0);
                            if (ii < in && jj < jn && sc < sn && first + t < limit)
                                v = static_cast<acc_t>(load(w + P::weight(first + t, s0 + sc, ah.kernel_index(jt + jj),
                                                                          aw.kernel_index(it + ii))));
                            ws[((sc * TJ + jj) * TI + ii) * OC_TILE + t] = v;
                        }
                        __syncthreads();
                        if (!active) continue;

                        const int j0 = max_of(my_j0, jt), j1 = min_of(my_j1, jt + TJ);
                        const int i0 = max_of(my_i0, it), i1 = min_of(my_i1, it + TI);
#pragma unroll 1
                        for (int sc = 0; sc < sn; ++sc) {
                            const index_t channel = static_cast<index_t>(g) * P::SRC_G + s0 + sc;
                            const scalar_t* plane = P::CHANNELS_LAST ? src + n * src_h * src_w * P::SRC_CH + channel
                                                                     : src + (n * P::SRC_CH + channel) * src_h * src_w;
#pragma unroll 1
                            for (int j = j0; j < j1; ++j) {
                                // The cells whose source row lies inside: a run c_lo <= c < c_hi, as
                                // the rows of consecutive cells move by the axis's SRC_STEP.
                                const index_t r = ah.src(vh, j);
                                int c_lo, c_hi;
                                ah.inside(r, src_h, cells, c_lo, c_hi);
                                // An offset, not a pointer: the rows of cells before c_lo lie outside.
                                const index_t row = r * row_pitch;
                                const acc_t* wrow = ws + (sc * TJ + j - jt) * TI * OC_TILE + lane * OCB;
#pragma unroll 1
                                for (int i = i0; i < i1; ++i) {
                                    const index_t col = aw.src(vw, i) * SRC_PITCH;
                                    acc_t wv[OCB];
                                    load_smem_small(wv, wrow + (i - it) * OC_TILE);
#pragma unroll
                                    for (int c = 0; c < CELLS; ++c) {
                                        if (c < c_lo || c >= c_hi) continue;
                                        const acc_t xv = static_cast<acc_t>(load(plane + (row + c * cell_pitch + col)));
#pragma unroll
                                        for (int o = 0; o < OCB; ++o) acc[c][o] += xv * wv[o];
                                    }
                                }
                            }
                        }
                    }

            if (!active) continue;
            const index_t col = aw.dst(vw);
#pragma unroll
            for (int c = 0; c < CELLS; ++c) {
                if (vh + c >= ah.count) break;
                const index_t row = ah.dst(vh + c);
#pragma unroll
                for (int o = 0; o < OCB; ++o) {
                    if (d + o >= limit) break;
                    const index_t at = P::CHANNELS_LAST ? ((n * dst_h + row) * dst_w + col) * DST_PITCH + d + o
                                                        : ((n * P::DST_CH + d + o) * dst_h + row) * dst_w + col;
                    store(dst + at, acc[c][o]);
                }
            }
        }
    }
}
