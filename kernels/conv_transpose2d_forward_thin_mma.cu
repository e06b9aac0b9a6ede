// The NCHW float32 forward of a transposed convolution with few output channels (an RGB generator's last layer)
// on the tensor cores (mma.sync m16n8k8, sm_80+) as TF32, or as 3xTF32 for strict float32; one group.
//
// One GEMM a block, then a gather in shared memory.  A block owns a TH x TW output tile of one image and stages
// the input window that tile reads (HR x HC pixels, its halo included), ICC input channels at a time, beside the
// chunk's weights: a ring of STAGES buffers that cp.async fills with no registers staging the data.  Both stay
// as x and w lay them out, [channel][row][column] and [channel][(tap, output channel) pair], the window's columns
// widened to whole 16-byte runs (VEC = 4) where the image's rows are, so that they land in 16-byte copies; the
// fragments come from them word by word.  The GEMM takes M = the window's pixels, N = every (tap, output
// channel) pair and K = the input channels: each input value is read from shared memory once a k-step for all its
// taps, where a GEMM a stride phase (M = output pixels, N = the few output channels) reads it once a tap.  Its
// result, what each window pixel sends through each tap, goes to shared memory, and each output pixel sums the
// terms its taps send it (a col2im of the tile).
#include "layer.cuh"
#include "mma.cuh"
#include "cp_async_pipeline.cuh"

constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int MMA_KIND = {{MMA_KIND}};       // MMA_TF32, or MMA_3XTF32 for strict float32
constexpr int PR = {{PR}};                  // input rows a tile's outputs take from (before the halo)
constexpr int PC = 16;                      // input columns likewise
constexpr int MI = {{MI}};                  // m16 tiles (window pixels) a warp
constexpr int NI = {{NI}};                  // n8 tiles ((tap, output channel) pairs) a warp: all of them
constexpr int ICC = TILE_K_WORDS;           // input channels a chunk: 64 bytes of K, two k8 steps
constexpr int TH = SH * PR, TW = SW * PC;   // the output tile
constexpr int WARPS = 4, THREADS = 32 * WARPS;
constexpr int PAIRS = TAPS * COUT;          // GEMM columns, in the weight's own order within an input channel
static_assert(COUT == COUT_G && GROUPS == 1, "one group");
static_assert(PAIRS <= NI * 8 && PAIRS > NI * 8 - 8, "the fewest n8 tiles that hold every pair");

__host__ __device__ constexpr int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
// Input window of a tile, relative to its input origin (tile row * PR): from the lowest row a tap reaches
// (phase 0, the last tap) to the highest (the last phase, tap 0).
constexpr int HR0 = floor_div(PH - (KH - 1) * DH, SH), HR_TOP = floor_div(SH - 1 + PH, SH);
constexpr int HC0 = floor_div(PW - (KW - 1) * DW, SW), HC_TOP = floor_div(SW - 1 + PW, SW);
constexpr int HR = PR + HR_TOP - HR0, HC = PC + HC_TOP - HC0;
constexpr int WINDOW = HR * HC;
constexpr int M_ROWS = WARPS * MI * 16, N_ROWS = NI * 8;
static_assert(WINDOW <= M_ROWS && WINDOW > M_ROWS - WARPS * 16, "the fewest m16 tiles a warp that hold the window");
// A window row spans columns floor(HC0) .. ceil(HC0 + HC) of whole VEC-word runs; pixel (r, c) of the window
// lies at r * HCV + c + CS of its channel's row.  A channel's row of HR x HCV words is padded to 8 mod 32 words,
// so a fragment's words (four channels by eight pixels) fall on distinct banks where its pixels share a row.
constexpr int VEC = {{VEC}};
constexpr int HC_LOW = floor_div(HC0, VEC) * VEC, HC_HIGH = -floor_div(-(HC0 + HC), VEC) * VEC;
constexpr int HCV = HC_HIGH - HC_LOW, CS = HC0 - HC_LOW;
constexpr int CHANNEL_WORDS = (HR * HCV + 23) / 32 * 32 + 8;
constexpr int WINDOW_WORDS = ICC * CHANNEL_WORDS;
// The chunk's weights likewise as w lays them out, [channel][pair]: a channel's pairs are one run of w.
constexpr int WEIGHT_PITCH = (N_ROWS + 23) / 32 * 32 + 8;
constexpr int STAGE_WORDS = WINDOW_WORDS + ICC * WEIGHT_PITCH;
constexpr int STAGES = {{STAGES}};
static_assert(WINDOW_WORDS % 4 == 0 && WEIGHT_PITCH % 4 == 0, "16-byte aligned buffers");
__host__ __device__ constexpr int pair_column(int tap, int oc) { return WEIGHT_CL ? tap * COUT + oc : oc * TAPS + tap; }
// The GEMM's result, [n][window pixel] over the stages once the last chunk is done: a pitch of 4 mod 32 words
// puts a fragment's stores (eight pixels by four even columns) on 32 banks, and the gather's reads of
// consecutive pixels on consecutive banks.
constexpr int D_PITCH = M_ROWS + 4;
static_assert(D_PITCH % 32 == 4, "conflict-free fragment stores");

// A chunk's copies into a stage: the window's VEC-word runs, zeros past the image and the channels (VEC divides
// W, so a run lies wholly inside a row or wholly outside it), then each channel's pairs, in 16-byte runs where
// they are whole runs of an aligned w, zeros past the last pair.  A thread keeps the same window positions (run
// of a window row) from chunk to chunk and takes them in every CH_GROUPS-th channel: where they lie, and whether
// inside the image, are worked out once.
constexpr int POSITIONS = HR * (HCV / VEC);
constexpr int CH_GROUPS = POSITIONS >= THREADS ? 1 : THREADS / POSITIONS;
constexpr int POS_SPAN = CH_GROUPS == 1 ? THREADS : POSITIONS;   // threads a channel group
constexpr int POS_ITERS = (POSITIONS + POS_SPAN - 1) / POS_SPAN;  // positions a thread
constexpr int CH_ITERS = (ICC + CH_GROUPS - 1) / CH_GROUPS;      // channels a thread takes each position in
// (word copies, 16 channels of two or more positions, unrolled held registers enough for ptxas to spill on sm_80)
constexpr int CH_UNROLL = VEC == 4 ? CH_ITERS : 4;
constexpr int WEIGHT_VEC = PAIRS % 4 == 0 ? 4 : 1;

struct WindowRuns {
    index_t source[POS_ITERS];   // offset of the run in its channel's plane of x
    int target[POS_ITERS];       // word of the run in its channel's window
    bool inside[POS_ITERS];
    int group;                   // first channel (CH_GROUPS past it: none of this thread's)

    __device__ __forceinline__ WindowRuns(index_t ih0, index_t iw0, index_t H, index_t W) {
        group = threadIdx.x / POS_SPAN;
#pragma unroll
        for (int k = 0; k < POS_ITERS; ++k) {
            const int position = threadIdx.x % POS_SPAN + k * POS_SPAN;
            const int r = position / (HCV / VEC), v = position % (HCV / VEC);
            const index_t ih = ih0 + r, iw = iw0 - CS + v * VEC;
            inside[k] = position < POSITIONS && ih >= 0 && ih < H && iw >= 0 && iw < W;
            source[k] = inside[k] ? ih * W + iw : 0;
            target[k] = position < POSITIONS ? r * HCV + v * VEC : -1;
        }
    }

    __device__ __forceinline__ void copy(unsigned* stage, const scalar_t* __restrict__ x, int n, int ic0,
                                         index_t plane) const {
        if (group >= CH_GROUPS) return;
        const scalar_t* channel = x + (static_cast<index_t>(n) * CIN + ic0 + group) * plane;
#pragma unroll
        for (int k = 0; k < POS_ITERS; ++k) {
            if (target[k] < 0) continue;
#pragma unroll CH_UNROLL
            for (int i = 0; i < CH_ITERS; ++i) {
                const int c = group + i * CH_GROUPS;
                const bool ok = inside[k] && ic0 + c < CIN;
                const scalar_t* at = ok ? channel + i * CH_GROUPS * plane + source[k] : x;
                const unsigned dst = smem_addr(stage + c * CHANNEL_WORDS + target[k]);
                if (c < ICC) {
                    if constexpr (VEC == 4) cp_async_16_l1(dst, at, ok); else cp_async_4(dst, at, ok);
                }
            }
        }
    }
};

template <int V>
__device__ __forceinline__ void copy_weights(unsigned* weight_tile, const scalar_t* __restrict__ w, int ic0) {
    constexpr int RUNS_A_CHANNEL = N_ROWS / V, COPIES = (ICC * RUNS_A_CHANNEL + THREADS - 1) / THREADS;
#pragma unroll 1
    for (int i = 0; i < COPIES; ++i) {
        const int e = threadIdx.x + i * THREADS;
        const int c = e / RUNS_A_CHANNEL, column = e % RUNS_A_CHANNEL * V;
        const bool ok = column < PAIRS && ic0 + c < CIN;
        const scalar_t* at = ok ? w + static_cast<index_t>(ic0 + c) * PAIRS + column : w;
        const unsigned dst = smem_addr(weight_tile + c * WEIGHT_PITCH + column);
        if (c < ICC) {
            if constexpr (V == 4) cp_async_16_l1(dst, at, ok); else cp_async_4(dst, at, ok);
        }
    }
}

__device__ __forceinline__ void copy_chunk(unsigned* stage, const WindowRuns& runs, const scalar_t* __restrict__ x,
                                           const scalar_t* __restrict__ w, int n, int ic0, index_t plane,
                                           bool w_aligned) {
    runs.copy(stage, x, n, ic0, plane);
    unsigned* weight_tile = stage + WINDOW_WORDS;
    if (WEIGHT_VEC == 4 && w_aligned) {
        copy_weights<4>(weight_tile, w, ic0);
    } else {
        copy_weights<1>(weight_tile, w, ic0);
    }
}

// A warp's MMAs over one k8 step of a stage, fragments read word by word: B's (every pair) at k rows t and t + 4,
// column g of each n8 tile; A's at the pixel offsets of the warp's rows.  TF32 rounds each operand once; 3xTF32
// splits each into TF32 big and small parts and adds the two cross products, smaller first, before big x big (a
// non-finite big part enters the cross products as zero, so that it meets no residual: as warp_tile_mma does).
__device__ __forceinline__ void mma_kstep(float (&acc)[MI][NI][4], const unsigned* stage, int ks,
                                          const int (&pixel_at)[MI][2], int lane) {
    const int g = lane / 4, t = lane % 4;
    const unsigned* b_row = stage + WINDOW_WORDS + (ks * KSTEP_WORDS + t) * WEIGHT_PITCH + g;
    // a0: (row g, k t), a1: (g + 8, t), a2: (g, t + 4), a3: (g + 8, t + 4)
    const unsigned* k_row = stage + (ks * KSTEP_WORDS + t) * CHANNEL_WORDS;
    unsigned a_raw[MI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int q = 0; q < 4; ++q) a_raw[i][q] = k_row[(q / 2) * 4 * CHANNEL_WORDS + pixel_at[i][q % 2]];
    if constexpr (MMA_KIND == MMA_3XTF32) {
        // (an n8 tile at a time, its B parts made once and each A's kept: the fewest live registers beside the
        // totals)
        unsigned a[MI][4], a_small[MI][4], a_cross[MI][4];
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                a[i][q] = to_tf32(a_raw[i][q]);
                a_small[i][q] = tf32_residual(a_raw[i][q], a[i][q]);
                a_cross[i][q] = finite_or_zero(a[i][q]);
            }
#pragma unroll
        for (int j = 0; j < NI; ++j) {
            unsigned b[2], b_small[2], b_cross[2];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const unsigned raw = b_row[q * 4 * WEIGHT_PITCH + j * 8];
                b[q] = to_tf32(raw);
                b_small[q] = tf32_residual(raw, b[q]);
                b_cross[q] = finite_or_zero(b[q]);
            }
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                mma_16x8<MMA_TF32>(acc[i][j], a_small[i], b_cross);
                mma_16x8<MMA_TF32>(acc[i][j], a_cross[i], b_small);
                mma_16x8<MMA_TF32>(acc[i][j], a[i], b);
            }
        }
    } else {
        unsigned b[NI][2];
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int q = 0; q < 2; ++q) b[j][q] = to_tf32(b_row[q * 4 * WEIGHT_PITCH + j * 8]);
#pragma unroll
        for (int i = 0; i < MI; ++i) {
            unsigned a[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) a[q] = to_tf32(a_raw[i][q]);
#pragma unroll
            for (int j = 0; j < NI; ++j) mma_16x8<MMA_TF32>(acc[i][j], a, b[j]);
        }
    }
}

// (three blocks an SM: 3xTF32's totals need more than the 128 registers of four)
constexpr int MIN_BLOCKS = MMA_KIND == MMA_3XTF32 ? 3 : 4;
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
conv_transpose2d_forward_thin_mma(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                                  const scalar_t* __restrict__ bias, scalar_t* __restrict__ y, index_t H, index_t W,
                                  index_t H_out, index_t W_out, index_t tiles_w) {
    static_assert(sizeof(scalar_t) == 4 && (MMA_KIND == MMA_TF32 || MMA_KIND == MMA_3XTF32), "float32 as TF32");
    extern __shared__ __align__(16) unsigned smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = blockIdx.y;
    const index_t tile_h = blockIdx.x / tiles_w, tile_w = blockIdx.x % tiles_w;
    const index_t ih0 = tile_h * PR + HR0, iw0 = tile_w * PC + HC0;
    const bool w_aligned = reinterpret_cast<unsigned long long>(w) % 16 == 0;
    const WindowRuns runs(ih0, iw0, H, W);

    // (3xTF32 moves each chunk's sums into an fp32 total: tensor-core accumulation does not round to nearest)
    float acc[MI][NI][4], total[MI][NI][4];
    zero(acc);
    zero(total);

    // The window offsets of this thread's fragment rows: m = warp*MI*16 + i*16 + lane/4 (+8); rows past the
    // window read pixel 0, and their results are never summed.
    int pixel_at[MI][2];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = warp * MI * 16 + i * 16 + lane / 4 + half * 8;
            pixel_at[i][half] = m < WINDOW ? (m / HC) * HCV + m % HC + CS : 0;
        }

    cp_async_pipeline<STAGES>(
        (CIN + ICC - 1) / ICC,
        [&](int chunk, int s) {
            copy_chunk(smem + s * STAGE_WORDS, runs, x, w, n, chunk * ICC, H * W, w_aligned);
        },
        [&](int s) {
#pragma unroll
            for (int ks = 0; ks < ICC / KSTEP_WORDS; ++ks) mma_kstep(acc, smem + s * STAGE_WORDS, ks, pixel_at, lane);
            if constexpr (MMA_KIND == MMA_3XTF32) promote(total, acc);
        });
    __syncthreads();  // every warp done with the stages the result overwrites

    // Fragment (i, j, r): window pixel warp*MI*16 + i*16 + lane/4 (+8 for r >= 2), column j*8 + 2*(lane%4) + r%2.
    float* sent = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                sent[(j * 8 + 2 * (lane % 4) + r % 2) * D_PITCH + warp * MI * 16 + i * 16 + lane / 4 + (r / 2) * 8] =
                    pick_result<MMA_KIND>(acc, total)[i][j][r];
    __syncthreads();

    // Output row SH * r + a of the tile takes tap kh where kh's offset from phase a is a whole number of strides,
    // from window row r + (a + PH - kh*DH) / SH - HR0; columns likewise.  A phase at a time, so that which taps
    // feed it, and from where, are constants; a thread takes a phase pixel of every column phase in turn.
    const index_t oh0 = tile_h * TH, ow0 = tile_w * TW;
#pragma unroll
    for (int a = 0; a < SH; ++a)
        for (int e = threadIdx.x; e < COUT * PR * PC; e += THREADS) {
            const int oc = e / (PR * PC), r = (e / PC) % PR, c = e % PC;
            const index_t oh = oh0 + SH * r + a;
            if (oh >= H_out) continue;
            const float* from = sent + pair_column(0, oc) * D_PITCH + r * HC + c;
#pragma unroll
            for (int b = 0; b < SW; ++b) {
                const index_t ow = ow0 + SW * c + b;
                if (ow >= W_out) continue;
                float v = 0.f;
#pragma unroll
                for (int kh = 0; kh < KH; ++kh) {
                    const int dr = a + PH - kh * DH;
                    if (dr % SH != 0) continue;
#pragma unroll
                    for (int kw = 0; kw < KW; ++kw) {
                        const int dc = b + PW - kw * DW;
                        if (dc % SW != 0) continue;
                        v += from[pair_column(kh * KW + kw, 0) * D_PITCH + (dr / SH - HR0) * HC + dc / SW - HC0];
                    }
                }
                if constexpr (HAS_BIAS) v += load(bias + oc);
                store(y + ((static_cast<index_t>(n) * COUT + oc) * H_out + oh) * W_out + ow, v);
            }
        }
}
