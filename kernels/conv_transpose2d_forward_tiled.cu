// Transposed-convolution forward on NCHW memory for layers with few channels per
// group (depthwise, grouped, dilated), where the work is moving bytes: each thread
// computes a TILE_R x TILE_V tile of output pixels for OCB output channels and writes
// every tile row with whole VEC-element vector stores.
//
// A tile starts on a multiple of the stride in both directions, so the stride phase
// of each of its rows and columns is a compile-time constant, and with it the taps
// that feed each output and the input row and column each tap reads: the unrolled tap
// loops are plain multiply-adds, with no phase tests and no index arithmetic.
//
// A block of TX x TY threads covers a TY x TX patch of tiles in one output plane (an
// "item": image, block of OCB output channels, patch).  It stages the input window the
// patch reads in shared memory, IC_CHUNK input channels at a time, converted to acc_t
// once and zero outside the input, so each input value is loaded once for the whole
// patch and no thread tests a bound.  Blocks are persistent: each walks a run of items, and while it
// computes one chunk its threads already hold the next chunk's window (and a depthwise
// layer's next weights) in registers, as stored, so the loads of the next step overlap
// this one's arithmetic and stores instead of stalling behind a barrier.
#include "layer.cuh"

constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int OCB = {{OCB}};        // output channels per thread, of one group
constexpr int TILE_R = {{TILE_R}};  // output rows per thread, a multiple of SH
constexpr int TILE_V = {{TILE_V}};  // output columns per thread, a multiple of SW and of VEC
constexpr int VEC = {{VEC}};        // elements per store; W_out is a multiple of it
constexpr int TX = {{TX}}, TY = {{TY}};  // the block's patch, in tiles
constexpr int IC_CHUNK = {{IC_CHUNK}};    // input channels staged at once
constexpr int MIN_BLOCKS = {{MIN_BLOCKS}};  // blocks an SM must hold: caps the registers (latency hiding)
// Stage the window two 16-bit cells a load (the input's width even and its pointer aligned): half the loads, and
// half the registers holding them, so a chunk takes twice the channels.
constexpr bool PAIRS = {{PAIRS}};
constexpr int BLOCK = TX * TY;
constexpr int OC_BLOCKS = (COUT_G + OCB - 1) / OCB;
constexpr int CHUNKS = (CIN_G + IC_CHUNK - 1) / IC_CHUNK;
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
// A store of 16-bit elements converted two at a time (VEC / 2 words; one where VEC is 1 and it goes unused).
constexpr int WORDS = VEC >= 2 ? VEC / 2 : 1;
struct __align__(WORDS * 4) Words { unsigned u[WORDS]; };

// The patch's window: a tile reads ROWS x COLS input cells from its first cell (TR x TC cells per tile).
constexpr int TR = TILE_R / SH, TC = TILE_V / SW;
constexpr int WR = (TY - 1) * TR + ROWS;
constexpr int WC = (TX - 1) * TC + COLS;
// Neighbouring lanes read their window rows TC words apart, where scalar reads would meet bank conflicts:
// they read whole 16-byte (8-byte) vectors instead, so rows are padded to whole vectors.
constexpr int VR_MAX = 16 / sizeof(acc_t);
constexpr int VR = TC % VR_MAX == 0 ? VR_MAX : TC % 2 == 0 ? 2 : 1;
constexpr int COLS_R = (COLS + VR - 1) / VR * VR;
constexpr int WC_PAD = ((TX - 1) * TC + COLS_R + VR - 1) / VR * VR;
constexpr int WEIGHTS = CIN_G * TAPS * OCB;

// The window loads a row a cell at a time, its padding included (zeros), so that load e is staged in cell e; or
// PAIRS, a pair at a time from even input columns (the patch's first one is even: TX is), the first load of a
// row starting SHIFT cells left of the window.  A row's pairs are whole, inside the input or outside it, since
// its width is even.
static_assert(!PAIRS || sizeof(scalar_t) == 2, "pairs of 16-bit cells");
constexpr int PAIR = PAIRS ? 2 : 1;
constexpr int SHIFT = (COL0 % PAIR + PAIR) % PAIR;
constexpr int SPAN = PAIRS ? (WC + SHIFT + 1) / 2 : WC_PAD;   // loads across a window row
constexpr int LOADS = IC_CHUNK * WR * SPAN;
// What each thread holds of the next chunk's window: a load each, as stored.
constexpr int HELD_X = (LOADS + BLOCK - 1) / BLOCK;
template <bool Pairs> struct HeldCells { typedef scalar_t type; };
template <> struct HeldCells<true> { typedef unsigned type; };
typedef HeldCells<PAIRS>::type held_t;

__device__ __forceinline__ void read_window_row(acc_t (&dst)[COLS_R], const acc_t* src) {
#pragma unroll
    for (int b = 0; b < COLS_R; b += VR) load_smem_small(*reinterpret_cast<acc_t(*)[VR]>(dst + b), src + b);
}

// An item's place: items run over (image, output-channel block, patch row, patch column), the last fastest, so
// a block's run of items mostly shares its weights.
struct Item {
    index_t n, ih, iw;   // image; the patch window's first input row and column
    int g, ocg0, ocb;    // group, its first output channel of the block's, and the channel block
    index_t bh, bw;      // patch row and column
};

__device__ __forceinline__ Item locate(index_t item, index_t blocks_w, index_t blocks_h) {
    Item it;
    it.bw = item % blocks_w;
    index_t rest = item / blocks_w;
    it.bh = rest % blocks_h;
    rest /= blocks_h;
    it.ocb = static_cast<int>(rest % (GROUPS * OC_BLOCKS));
    it.n = rest / (GROUPS * OC_BLOCKS);
    it.g = it.ocb / OC_BLOCKS;
    it.ocg0 = it.ocb % OC_BLOCKS * OCB;
    it.ih = it.bh * (TY * TR) + ROW0;
    it.iw = it.bw * (TX * TC) + COL0;
    return it;
}

// threadIdx.x, hidden from the compiler's loop-invariant code motion: each staged cell's indices depend on the
// thread alone, and hoisted out of the walk over items they took three registers a held cell and spilled
// (ptxas sm_90, grouped layers); recomputed, they cost a few integer instructions per load.
__device__ __forceinline__ int opaque_tid() {
#ifdef __CUDA_ARCH__
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
#else
    return threadIdx.x;
#endif
}

template <typename T>
__device__ __forceinline__ held_t load_cells(const T* p) {
    if constexpr (PAIRS) return load_pair_raw(p);
    else return load_raw(p);
}

// This thread's share of a chunk's window: loads threadIdx.x + k * BLOCK of [IC_CHUNK][WR][SPAN].
__device__ __forceinline__ void fetch_window(held_t (&held)[HELD_X], const scalar_t* x, const Item& it, int chunk,
                                             index_t H, index_t W) {
    const scalar_t* planes = x + (it.n * CIN + it.g * CIN_G + chunk * IC_CHUNK) * H * W;
    const int tid = opaque_tid();
#pragma unroll
    for (int k = 0; k < HELD_X; ++k) {
        const int e = tid + k * BLOCK;
        const int icl = e / (WR * SPAN), r = e / SPAN % WR, c = e % SPAN * PAIR - SHIFT;
        const index_t ih = it.ih + r, iw = it.iw + c;
        const bool inside = (LOADS % BLOCK == 0 || e < LOADS)
                            && (CIN_G % IC_CHUNK == 0 || chunk * IC_CHUNK + icl < CIN_G)
                            && c < WC && ih >= 0 && ih < H && iw >= 0 && iw < W;
        held[k] = inside ? load_cells(planes + icl * H * W + ih * W + iw) : held_t{};
    }
}

template <int HELD, int SIZE, typename Held>
__device__ __forceinline__ void put(acc_t* dst, const Held (&held)[HELD]) {
#pragma unroll
    for (int k = 0; k < HELD; ++k) {
        const int e = threadIdx.x + k * BLOCK;
        if (SIZE % BLOCK == 0 || e < SIZE) dst[e] = widen(held[k]);
    }
}

// The held window into [IC_CHUNK][WR][WC_PAD], widened; a pair's cells left of the window or past its padded
// rows are dropped (the thread's cells recomputed, not held across the walk: see opaque_tid).
template <typename Held>
__device__ __forceinline__ void put_window(acc_t* xs, const Held (&held)[HELD_X]) {
    if constexpr (!PAIRS) {
        put<HELD_X, LOADS>(xs, held);
    } else {
        const int tid = opaque_tid();
#pragma unroll
        for (int k = 0; k < HELD_X; ++k) {
            const int e = tid + k * BLOCK;
            if (LOADS % BLOCK != 0 && e >= LOADS) continue;
            const int row = e / SPAN, c = e % SPAN * 2 - SHIFT;
            float v[2];
            widen_pair<scalar_t>(held[k], v);
#pragma unroll
            for (int q = 0; q < 2; ++q)
                if ((SHIFT == 0 || c + q >= 0) && (SPAN * 2 - SHIFT <= WC_PAD || c + q < WC_PAD))
                    xs[row * WC_PAD + c + q] = v[q];
        }
    }
}

// Its share of the block's weights, [ic][tap][o] for the item's OCB output channels (zero past the group's), and
// after them the channels' bias.
constexpr int STAGED_W = WEIGHTS + OCB;
constexpr int HELD_W = (STAGED_W + BLOCK - 1) / BLOCK;
// A depthwise block's weights change every item or two, and a thread holds a register or two of them; a wider
// group's change seldom, and holding them would take registers the tap loops need: those load when staged.
constexpr bool HOLD_WEIGHTS = HELD_W <= 2;

__device__ __forceinline__ void fetch_weights(scalar_t (&held)[HELD_W], const scalar_t* w, const scalar_t* bias,
                                              const Item& it) {
    const int tid = opaque_tid();
#pragma unroll
    for (int k = 0; k < HELD_W; ++k) {
        const int e = tid + k * BLOCK;
        if (e < WEIGHTS) {
            const int ic = e / (TAPS * OCB), tap = e / OCB % TAPS, o = e % OCB;
            held[k] = it.ocg0 + o < COUT_G ? load_raw(w + weight_index(it.g * CIN_G + ic, it.ocg0 + o, tap))
                                           : scalar_t{};
        } else {
            const int o = e - WEIGHTS;
            held[k] = HAS_BIAS && o < OCB && it.ocg0 + o < COUT_G ? load_raw(bias + it.g * COUT_G + it.ocg0 + o)
                                                                  : scalar_t{};
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS)
conv_transpose2d_forward_tiled(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                               const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                               index_t H, index_t W, index_t H_out, index_t W_out,
                               index_t blocks_w, index_t blocks_h, index_t items) {
    __shared__ __align__(16) acc_t ws[STAGED_W];
    __shared__ __align__(16) acc_t xs[IC_CHUNK][WR][WC_PAD];
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    const index_t per_block = (items + gridDim.x - 1) / gridDim.x;
    const index_t first = blockIdx.x * per_block;
    const index_t last = first + per_block < items ? first + per_block : items;
    if (first >= last) return;

    // The next step's loads, as stored: widened when staged, so that they stay in flight until then.
    held_t held_x[HELD_X];
    scalar_t held_w[HELD_W];
    Item it = locate(first, blocks_w, blocks_h);
    fetch_window(held_x, x, it, 0, H, W);
    if (HOLD_WEIGHTS) fetch_weights(held_w, w, bias, it);
    bool new_weights = true;   // the item about to be staged starts a channel block

    for (index_t item = first; item < last; ++item) {
        acc_t acc[TILE_R][TILE_V][OCB];
        for (int chunk = 0; chunk < CHUNKS; ++chunk) {
            __syncthreads();  // every thread is done with the previous chunk's window and weights
            put_window(&xs[0][0][0], held_x);
            if (new_weights) {
                if (!HOLD_WEIGHTS) fetch_weights(held_w, w, bias, it);
                put<HELD_W, STAGED_W>(ws, held_w);
            }
            __syncthreads();

            // The next step's loads, in flight while this one computes.
            new_weights = false;
            if (chunk + 1 < CHUNKS) {
                fetch_window(held_x, x, it, chunk + 1, H, W);
            } else if (item + 1 < last) {
                const Item next = locate(item + 1, blocks_w, blocks_h);
                fetch_window(held_x, x, next, 0, H, W);
                new_weights = next.ocb != it.ocb;
                if (HOLD_WEIGHTS && new_weights) fetch_weights(held_w, w, bias, next);
            }

            if (chunk == 0) {
#pragma unroll
                for (int o = 0; o < OCB; ++o) {
                    const acc_t b0 = ws[WEIGHTS + o];
#pragma unroll
                    for (int r = 0; r < TILE_R; ++r)
#pragma unroll
                        for (int v = 0; v < TILE_V; ++v) acc[r][v][o] = b0;
                }
            }
            const int channels = CIN_G % IC_CHUNK == 0 || chunk + 1 < CHUNKS ? IC_CHUNK : CIN_G % IC_CHUNK;
#pragma unroll 1   // a channel at a time: the registers the planner budgets for one
            for (int icl = 0; icl < channels; ++icl) {
                const acc_t* wc = ws + (chunk * IC_CHUNK + icl) * TAPS * OCB;
#pragma unroll
                for (int a = 0; a < ROWS; ++a) {
                    acc_t xv[COLS_R];
                    read_window_row(xv, &xs[icl][ty * TR + a][tx * TC]);
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

        const index_t oh0 = (it.bh * TY + ty) * TILE_R, ow0 = (it.bw * TX + tx) * TILE_V;
        if (ow0 < W_out) {
            const bool whole_row = ow0 + TILE_V <= W_out;
#pragma unroll
            for (int o = 0; o < OCB; ++o) {
                if (it.ocg0 + o >= COUT_G) break;
                scalar_t* plane = y + (it.n * COUT + it.g * COUT_G + it.ocg0 + o) * H_out * W_out;
#pragma unroll
                for (int r = 0; r < TILE_R; ++r) {
                    if (oh0 + r >= H_out) break;
                    scalar_t* row = plane + (oh0 + r) * W_out + ow0;
                    if (whole_row) {
#pragma unroll
                        for (int s = 0; s < TILE_V; s += VEC) {
                            if constexpr (sizeof(scalar_t) == 2 && VEC % 2 == 0) {
                                Words p;
#pragma unroll
                                for (int e = 0; e < WORDS; ++e)
                                    p.u[e] = pack_pair<scalar_t>(acc[r][s + 2 * e][o], acc[r][s + 2 * e + 1][o]);
                                *reinterpret_cast<Words*>(row + s) = p;
                            } else {
                                Packet<VEC> p;
#pragma unroll
                                for (int e = 0; e < VEC; ++e) store(&p.v[e], acc[r][s + e][o]);
                                *reinterpret_cast<Packet<VEC>*>(row + s) = p;
                            }
                        }
                    } else {
#pragma unroll
                        for (int v = 0; v < TILE_V; ++v)
                            if (ow0 + v < W_out) store(row + v, acc[r][v][o]);
                    }
                }
            }
        }
        if (item + 1 < last) it = locate(item + 1, blocks_w, blocks_h);
    }
}
