// Transposed-convolution forward on NCHW memory for layers with few channels per
// group (depthwise, grouped, dilated), where the work is moving bytes: each thread
// computes a TILE_R x TILE_V tile of output pixels for OCB output channels and writes
// every tile row with whole VEC-element vector stores.
//
// A tile starts on a multiple of the stride in both directions, so the stride phase
// of each of its rows and columns is a compile-time constant, and with it the taps
// that feed each output and the input row and column each tap reads.  Per input
// channel a thread loads the window of input rows and columns its tile reads once,
// and the unrolled tap loops are then plain multiply-adds on that window: no phase
// tests, no division, no index arithmetic.  The block's weights, [ic][tap][o] for its
// OCB output channels, sit in shared memory and every thread reads the same address,
// so each tap's OCB weights come in one broadcast vector load.
#include "layer.cuh"
#include "direct.cuh"

constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int OCB = {{OCB}};        // output channels per thread, of one group
constexpr int TILE_R = {{TILE_R}};  // output rows per thread, a multiple of SH
constexpr int TILE_V = {{TILE_V}};  // output columns per thread, a multiple of SW and of VEC
constexpr int VEC = {{VEC}};        // elements per store; W_out is a multiple of it
constexpr int BLOCK = {{BLOCK}};
constexpr int MIN_BLOCKS = {{MIN_BLOCKS}};  // blocks an SM must hold: caps the registers (latency hiding)
constexpr int OC_BLOCKS = (COUT_G + OCB - 1) / OCB;
static_assert(TILE_R % SH == 0 && TILE_V % SW == 0 && TILE_V % VEC == 0, "tiles start on whole stride periods");

// Along one axis (stride S, padding P, dilation D), tap t feeds tile position i when their stride phases
// agree; it then reads the input position tap_offset(i, t) past the tile's first cell (ih0 = oh0 / SH for rows).
__host__ __device__ constexpr int tap_offset(int i, int t, int S, int P, int D) { return (i + P) / S - (t * D) / S; }
__host__ __device__ constexpr int tap_col(int v, int kw) { return tap_offset(v, kw, SW, PW, DW); }

// The first (last) input position that a tile of `extent` positions reads along an axis of K taps.
__host__ __device__ constexpr int window_edge(int extent, int K, int S, int P, int D, bool last) {
    int m = last ? -(1 << 30) : 1 << 30;
    for (int i = 0; i < extent; ++i)
        for (int t = 0; t < K; ++t) {
            if ((t * D) % S != (i + P) % S) continue;
            const int offset = tap_offset(i, t, S, P, D);
            if (last ? offset > m : offset < m) m = offset;
        }
    return m;
}

// A tile spans whole stride periods, and tap 0 feeds phase 0 of each axis, so some tile row and
// column always read: the window is never empty.
constexpr int ROW0 = window_edge(TILE_R, KH, SH, PH, DH, false);
constexpr int ROWS = window_edge(TILE_R, KH, SH, PH, DH, true) - ROW0 + 1;
constexpr int COL0 = window_edge(TILE_V, KW, SW, PW, DW, false);
constexpr int COLS = window_edge(TILE_V, KW, SW, PW, DW, true) - COL0 + 1;

// The tile row that input window row a feeds through tap kh (outside [0, TILE_R) if none): the row whose
// phase is the tap's and whose cell row lies a rows into the window.
__host__ __device__ constexpr int row_of(int a, int kh) {
    return SH * (ROW0 + a + (kh * DH) / SH) + (kh * DH) % SH - PH;
}
// The first tile column tap kw feeds; it feeds every SW-th one from there (a tile spans whole periods).
__host__ __device__ constexpr int first_col_of(int kw) { return ((kw * DW - PW) % SW + SW) % SW; }

template <int N>
struct __align__(N * sizeof(scalar_t)) Packet { scalar_t v[N]; };

// acc += the tile's taps over the group's input channels (xg: the group's first plane, shifted to the window's
// first column); CHECKED tests each window row and column against the input's bounds.
template <bool CHECKED>
__device__ __forceinline__ void accumulate(acc_t (&acc)[TILE_R][TILE_V][OCB], const scalar_t* xg, const acc_t* ws,
                                           index_t plane_size, const index_t (&row_offset)[ROWS],
                                           const bool (&row_ok)[ROWS], const bool (&col_ok)[COLS]) {
    for (int ic = 0; ic < CIN_G; ++ic) {
        const scalar_t* plane = xg + ic * plane_size;
        const acc_t* wc = ws + ic * TAPS * OCB;
#pragma unroll
        for (int a = 0; a < ROWS; ++a) {
            acc_t xv[COLS];
#pragma unroll
            for (int b = 0; b < COLS; ++b)
                xv[b] = !CHECKED || (row_ok[a] && col_ok[b]) ? static_cast<acc_t>(load(plane + row_offset[a] + b))
                                                             : acc_t(0);
#pragma unroll
            for (int kh = 0; kh < KH; ++kh) {
                const int r = row_of(a, kh);
                if (r < 0 || r >= TILE_R) continue;
#pragma unroll
                for (int kw = 0; kw < KW; ++kw) {
                    acc_t wv[OCB];
                    load_smem_small(wv, wc + (kh * KW + kw) * OCB);
#pragma unroll
                    for (int v = first_col_of(kw); v < TILE_V; v += SW)
#pragma unroll
                        for (int o = 0; o < OCB; ++o) acc[r][v][o] += xv[tap_col(v, kw) - COL0] * wv[o];
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
conv_transpose2d_forward_tiled(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                               const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                               index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                               index_t tiles_w, index_t tiles) {
    __shared__ __align__(16) acc_t ws[CIN_G * TAPS * OCB];
    const index_t t = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x;
    const bool active = t < tiles;
    const index_t oh0 = (active ? t / tiles_w : 0) * TILE_R;
    const index_t ow0 = (active ? t % tiles_w : 0) * TILE_V;
    const index_t ih0 = oh0 / SH + ROW0, iw0 = ow0 / SW + COL0;

    // Offsets and bounds of the input window, tested once.
    index_t row_offset[ROWS];
    bool row_ok[ROWS];
#pragma unroll
    for (int a = 0; a < ROWS; ++a) {
        row_ok[a] = active && ih0 + a >= 0 && ih0 + a < H;
        row_offset[a] = (ih0 + a) * W;
    }
    bool col_ok[COLS];
#pragma unroll
    for (int b = 0; b < COLS; ++b) col_ok[b] = iw0 + b >= 0 && iw0 + b < W;
    const bool interior = active && ih0 >= 0 && ih0 + ROWS <= H && iw0 >= 0 && iw0 + COLS <= W;

    for (int ocb = blockIdx.y; ocb < GROUPS * OC_BLOCKS; ocb += gridDim.y) {
        const int g = ocb / OC_BLOCKS;
        const int ocg0 = (ocb % OC_BLOCKS) * OCB;
        stage_weight_taps<CIN_G, OCB, BLOCK>(ws, [&](int ic, int tap, int o) {
            return ocg0 + o < COUT_G ? static_cast<acc_t>(load(w + weight_index(g * CIN_G + ic, ocg0 + o, tap)))
                                     : acc_t(0);
        });

        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[TILE_R][TILE_V][OCB];
#pragma unroll
            for (int o = 0; o < OCB; ++o) {
                const acc_t b0 = HAS_BIAS && ocg0 + o < COUT_G ? static_cast<acc_t>(load(bias + g * COUT_G + ocg0 + o))
                                                              : acc_t(0);
#pragma unroll
                for (int r = 0; r < TILE_R; ++r)
#pragma unroll
                    for (int v = 0; v < TILE_V; ++v) acc[r][v][o] = b0;
            }

            const scalar_t* xg = x + (n * CIN + g * CIN_G) * H * W + iw0;
            // Most tiles read no pixel outside the input: they load with no bounds tests.
            if (interior)
                accumulate<false>(acc, xg, ws, H * W, row_offset, row_ok, col_ok);
            else
                accumulate<true>(acc, xg, ws, H * W, row_offset, row_ok, col_ok);

            if (!active) continue;
            const bool whole_row = ow0 + TILE_V <= W_out;
#pragma unroll
            for (int o = 0; o < OCB; ++o) {
                if (ocg0 + o >= COUT_G) break;
                scalar_t* plane = y + (n * COUT + g * COUT_G + ocg0 + o) * H_out * W_out;
#pragma unroll
                for (int r = 0; r < TILE_R; ++r) {
                    if (oh0 + r >= H_out) break;
                    scalar_t* row = plane + (oh0 + r) * W_out + ow0;
                    if (whole_row) {
#pragma unroll
                        for (int s = 0; s < TILE_V; s += VEC) {
                            Packet<VEC> p;
#pragma unroll
                            for (int e = 0; e < VEC; ++e) store(&p.v[e], acc[r][s + e][o]);
                            *reinterpret_cast<Packet<VEC>*>(row + s) = p;
                        }
                    } else {
#pragma unroll
                        for (int v = 0; v < TILE_V; ++v)
                            if (ow0 + v < W_out) store(row + v, acc[r][v][o]);
                    }
                }
            }
        }
    }
}
