// Forward and grad_input of a transposed convolution as tensor-core implicit GEMMs.
//
// Both passes gather from an activation tensor ("src") and scatter into another
// ("dst"), with M = dst pixels, N = dst channels of the group and K = src channels
// of the group times kernel taps:
//   forward (MODE 0): src = x, dst = y, one GEMM per stride phase (blockIdx.z).
//     Output rows oh = rh + SH*i of phase rh read input rows i + (rh + PH - kh*DH)/SH
//     for exactly the taps kh with (rh + PH - kh*DH) % SH == 0, so no tap is
//     multiplied by a structural zero; a phase without taps stores the bias.
//   grad_input (MODE 1): src = grad_out, dst = grad_in, a strided conv2d:
//     grad_in row i reads grad_out rows SH*i + kh*DH - PH for every tap.
// K runs tap-major, then channel chunks, so one K tile shares one tap and the
// bounds test is per row, not per element.  The weight arrives repacked by
// pack_weight.cu, so B tiles are plain 16-byte vector loads.  A channels_last 16-bit weight is
// read in place (WEIGHT_DIRECT): its memory runs (C_in, KH, KW, C_out / GROUPS), so for each input
// channel and tap the output channels are one contiguous run.  For grad_input that run is K, as in
// the pack, and only the strides and the zeros past the channels differ; for the forward it is N,
// so the B tile lands as BK rows of BN output channels and its fragments come by ldmatrix.trans.
// When the source is channels_last with 16-byte aligned channel runs (A_VEC; NCHW
// sources are transposed into that form first by to_channels_last.cu), both tiles
// are cp.async copies into a STAGES-deep ring of shared buffers, so several tiles'
// global latency overlaps the tensor-core work and no registers stage the data.
// Otherwise A is gathered element by element through registers, one tile ahead.
// The source and destination layouts are independent (SRC_CL, DST_CL).
// With SPLIT_K > 1 each block takes one of SPLIT_K even ranges of its phase's K tiles
// (grid z is phase x SPLIT_K) and writes fp32 partial sums, without the bias, into
// dst reinterpreted as [SPLIT_K][the destination's elements], in the destination's
// layout; reduce_partials.cu adds them in order.  Layers whose M x N grid leaves most
// SMs idle (a few images of a small grid, wide channels) are weight-bound, and only
// more blocks, each reading a slice of the weight, bring its bandwidth in.
#include "layer.cuh"
#include "mma.cuh"
#include "gemm_tile.cuh"
#include "cp_async_pipeline.cuh"

constexpr int MODE = {{MODE}};
constexpr bool SRC_CL = {{SRC_CL}};   // source activations channels_last
constexpr bool DST_CL = {{DST_CL}};   // destination channels_last
constexpr int STAGES = {{STAGES}};
constexpr bool HAS_BIAS = {{HAS_BIAS}} && MODE == 0;
constexpr bool A_VEC = {{A_VEC}};
constexpr bool A_L1 = {{A_L1}};       // A copies through L1 (see cp_async_16_l1)
constexpr int SPLIT_K = {{SPLIT_K}};
constexpr bool WEIGHT_DIRECT = {{WEIGHT_DIRECT}};   // B from a channels_last weight in place, not a packed copy

constexpr int CG_K = MODE == 0 ? CIN_G : COUT_G;  // src channels per group: the K of the GEMM
constexpr int CG_N = MODE == 0 ? COUT_G : CIN_G;  // dst channels per group: the N of the GEMM
constexpr int C_SRC = CG_K * GROUPS, C_DST = CG_N * GROUPS;
constexpr int CHUNKS = (CG_K + BK - 1) / BK;
constexpr int N_TILES = (CG_N + BN - 1) / BN;
// packed weight (pack_weight.cu): [GROUPS][TAPS][N_PAD][K_PAD]
constexpr int N_PAD = N_TILES * BN, K_PAD = CHUNKS * BK;
constexpr bool A_ROWS_FASTEST = !SRC_CL;   // NCHW: neighbouring pixels are adjacent
constexpr int A_WORDS = BM * TILE_K_WORDS / THREADS;
constexpr int VEC_PER_ROW = TILE_K_WORDS / 4;     // 16-byte vectors per 64-byte tile row
constexpr int A_VECS = BM * VEC_PER_ROW / THREADS;
constexpr int B_VECS = BN * VEC_PER_ROW / THREADS;
static_assert(!A_VEC || (SRC_CL && CG_K % (4 * PER_WORD) == 0), "vector loads need whole channel runs");
static_assert(A_VEC ? STAGES >= 2 : STAGES == 2, "the register-staged path double-buffers");
constexpr int STAGE_WORDS = (BM + BN) * ROW_WORDS;

static_assert(A_WORDS >= 1 && A_VECS >= 1 && B_VECS >= 1, "every thread loads part of each tile");
static_assert(!WEIGHT_DIRECT || (WEIGHT_CL && sizeof(scalar_t) == 2 && COUT_G % 8 == 0),
              "a weight read in place: channels_last, 16 bits, whole 16-byte output channel runs");
// The forward's B tile from a weight in place: BK rows of BN output channels, B_K_PITCH words apart (16-byte
// aligned rows whose eight ldmatrix row addresses fall on distinct banks), within a stage's B part.
constexpr bool B_K_ROWS = WEIGHT_DIRECT && MODE == 0;
constexpr int B_K_PITCH = B_K_ROWS ? BN / 2 + 4 : 0;
constexpr int B_ROW_VECS = BN / 8;   // 16-byte vectors along one such row
static_assert(BK * B_K_PITCH <= BN * ROW_WORDS, "[K][N] B tiles fit the stage's B part");

typedef TileMap<BM, A_ROWS_FASTEST, THREADS> AMap;

struct Tap { int dh, dw, w; };

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
conv_transpose2d_igemm(const scalar_t* __restrict__ src, const scalar_t* __restrict__ packed_weight,
                       const scalar_t* __restrict__ bias, scalar_t* __restrict__ dst,
                       index_t N, index_t H_SRC, index_t W_SRC, index_t H_DST, index_t W_DST) {
    extern __shared__ __align__(16) unsigned stage_smem[];  // STAGES x (A tile, B tile)
    __shared__ int row_n[BM], row_i[BM], row_j[BM];
    __shared__ Tap taps[TAPS];
    __shared__ int tap_count;
    auto a_tile = [&](int s) { return stage_smem + s * STAGE_WORDS; };
    auto b_tile = [&](int s) { return stage_smem + s * STAGE_WORDS + BM * ROW_WORDS; };

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // Rows i, cols j of this GEMM's M grid map to dst (O_SH*i + rh, O_SW*j + rw) and
    // read src (A_SH*i + tap.dh, A_SW*j + tap.dw).
    const int phase = static_cast<int>(blockIdx.z) / SPLIT_K, split = static_cast<int>(blockIdx.z) % SPLIT_K;
    const int rh = MODE == 0 ? phase / SW : 0;
    const int rw = MODE == 0 ? phase % SW : 0;
    constexpr int O_SH = MODE == 0 ? SH : 1, O_SW = MODE == 0 ? SW : 1;
    constexpr int A_SH = MODE == 0 ? 1 : SH, A_SW = MODE == 0 ? 1 : SW;
    const index_t MH = rh < H_DST ? (H_DST - rh + O_SH - 1) / O_SH : 0;
    const index_t MW = rw < W_DST ? (W_DST - rw + O_SW - 1) / O_SW : 0;
    const index_t M = N * MH * MW;
    const index_t m0 = static_cast<index_t>(blockIdx.x) * BM;
    if (m0 >= M) return;
    const int g = blockIdx.y / N_TILES;
    const int n0 = (blockIdx.y % N_TILES) * BN;

    if (tid == 0) {
        int count = 0;
        for (int kh = 0; kh < KH; ++kh) {
            const int th = MODE == 0 ? rh + PH - kh * DH : kh * DH - PH;
            if (MODE == 0 && th % SH != 0) continue;
            for (int kw = 0; kw < KW; ++kw) {
                const int tw = MODE == 0 ? rw + PW - kw * DW : kw * DW - PW;
                if (MODE == 0 && tw % SW != 0) continue;
                taps[count++] = Tap{MODE == 0 ? th / SH : th, MODE == 0 ? tw / SW : tw, kh * KW + kw};
            }
        }
        tap_count = count;
    }
    for (int r = tid; r < BM; r += THREADS) {
        const index_t m = m0 + r;
        if (m < M) {
            const index_t pix = m % (MH * MW);
            row_n[r] = static_cast<int>(m / (MH * MW));
            row_i[r] = static_cast<int>(pix / MW);
            row_j[r] = static_cast<int>(pix % MW);
        } else {
            row_n[r] = -1; row_i[r] = 0; row_j[r] = 0;
        }
    }
    __syncthreads();
    // This block's K tiles: [kt0, kt0 + k_tiles) of its phase's tap_count * CHUNKS.
    const int phase_k_tiles = tap_count * CHUNKS;
    const int per_split = (phase_k_tiles + SPLIT_K - 1) / SPLIT_K;
    const int kt0 = min(phase_k_tiles, split * per_split);
    const int k_tiles = min(phase_k_tiles - kt0, per_split);

    const index_t src_plane = H_SRC * W_SRC;
    const index_t src_batch = src_plane * C_SRC;
    const index_t src_c_stride = SRC_CL ? 1 : src_plane;
    const scalar_t* src_group = src + static_cast<index_t>(g) * CG_K * src_c_stride;
    const scalar_t* w_group = packed_weight + static_cast<index_t>(g) * TAPS * N_PAD * K_PAD
                              + static_cast<index_t>(n0) * K_PAD;

    // A vector lands where it came from: row v / VEC_PER_ROW, words 4 * (v % VEC_PER_ROW) on.
    auto vector_slot = [&](unsigned* tile, int q) {
        const int v = tid + q * THREADS;
        return tile + (v / VEC_PER_ROW) * ROW_WORDS + (v % VEC_PER_ROW) * 4;
    };
    // Where B vector q of K tile kt comes from, and whether it lies inside the weight: a weight read in place
    // has no padding, so its vectors past the group's channels are zeros.
    auto b_source = [&](int kt, int q, bool& ok) -> const scalar_t* {
        const int v = tid + q * THREADS;
        if constexpr (B_K_ROWS) {
            const int k = (kt % CHUNKS) * BK + v / B_ROW_VECS, n = n0 + v % B_ROW_VECS * 8;
            ok = k < CG_K && n < CG_N;
            return ok ? packed_weight + weight_index(static_cast<index_t>(g) * CG_K + k, n, taps[kt / CHUNKS].w)
                      : packed_weight;
        } else if constexpr (WEIGHT_DIRECT) {
            const int n = n0 + v / VEC_PER_ROW, k = (kt % CHUNKS) * BK + (v % VEC_PER_ROW) * 4 * PER_WORD;
            ok = n < CG_N && k < CG_K;
            return ok ? packed_weight + weight_index(static_cast<index_t>(g) * CG_N + n, k, taps[kt / CHUNKS].w)
                      : packed_weight;
        } else {
            ok = true;
            return w_group + static_cast<index_t>(taps[kt / CHUNKS].w) * N_PAD * K_PAD + (kt % CHUNKS) * BK
                   + static_cast<index_t>(v / VEC_PER_ROW) * K_PAD + (v % VEC_PER_ROW) * 4 * PER_WORD;
        }
    };

    // Where B vector q of a tile lands: its row of n and K words, or in a [K][N] tile its k row and n words.
    auto b_slot = [&](unsigned* tile, int q) {
        if constexpr (B_K_ROWS) {
            const int v = tid + q * THREADS;
            return tile + (v / B_ROW_VECS) * B_K_PITCH + (v % B_ROW_VECS) * 4;
        } else {
            return vector_slot(tile, q);
        }
    };

    float acc[MI][NI][4], total[MI][NI][4];
    zero(acc);
    zero(total);
    const int warp_row = (warp / WARPS_N) * WM, warp_col = (warp % WARPS_N) * WN;

    if constexpr (A_VEC) {
        // Each thread copies the same A rows for every K tile: keep their coordinates.
        const scalar_t* a_row[A_VECS];
        int a_i[A_VECS], a_j[A_VECS], a_k[A_VECS];
#pragma unroll
        for (int q = 0; q < A_VECS; ++q) {
            const int v = tid + q * THREADS;
            const int r = v / VEC_PER_ROW;
            a_row[q] = row_n[r] >= 0 ? src_group + row_n[r] * src_batch : nullptr;
            a_i[q] = A_SH * row_i[r];
            a_j[q] = A_SW * row_j[r];
            a_k[q] = (v % VEC_PER_ROW) * 4 * PER_WORD;
        }
        auto issue = [&](int step, int s) {
            const int kt = kt0 + step;
            const Tap tap = taps[kt / CHUNKS];
            const int c0 = (kt % CHUNKS) * BK;
#pragma unroll
            for (int q = 0; q < A_VECS; ++q) {
                const int ih = a_i[q] + tap.dh, iw = a_j[q] + tap.dw, k = c0 + a_k[q];
                const bool ok = a_row[q] != nullptr && ih >= 0 && ih < H_SRC && iw >= 0 && iw < W_SRC && k < CG_K;
                const scalar_t* p = ok ? a_row[q] + (static_cast<index_t>(ih) * W_SRC + iw) * C_SRC + k : src;
                cp_async_16_via<A_L1>(smem_addr(vector_slot(a_tile(s), q)), p, ok);
            }
#pragma unroll
            for (int q = 0; q < B_VECS; ++q) {
                bool ok;
                const scalar_t* p = b_source(kt, q, ok);
                cp_async_16(smem_addr(b_slot(b_tile(s), q)), p, ok);
            }
        };
        cp_async_pipeline<STAGES>(k_tiles, issue, [&](int cur) {
            warp_tile_mma<KIND, MI, NI, B_K_PITCH>(acc, a_tile(cur), b_tile(cur), warp_row, warp_col, lane);
            if constexpr (KIND == MMA_3XTF32) promote(total, acc);
        });
    } else {
        unsigned a_regs[A_WORDS];
        uint4 b_vecs[B_VECS];
        auto load_tiles = [&](int step) {
            const int kt = kt0 + step;
            const Tap tap = taps[kt / CHUNKS];
            const int c0 = (kt % CHUNKS) * BK;
#pragma unroll
            for (int q = 0; q < A_WORDS; ++q) {
                const int r = AMap::row(tid, q);
                const int k = c0 + AMap::word(tid, q) * PER_WORD;
                const index_t ih = static_cast<index_t>(A_SH) * row_i[r] + tap.dh;
                const index_t iw = static_cast<index_t>(A_SW) * row_j[r] + tap.dw;
                const bool ok = row_n[r] >= 0 && ih >= 0 && ih < H_SRC && iw >= 0 && iw < W_SRC;
                const index_t pixel = ih * W_SRC + iw;
                const scalar_t* p = src_group + row_n[r] * src_batch + (SRC_CL ? pixel * C_SRC : pixel)
                                    + k * src_c_stride;
                unsigned word = 0;
#pragma unroll
                for (int e = 0; e < PER_WORD; ++e)
                    word |= raw_bits(p + e * src_c_stride, ok && k + e < CG_K) << (16 * e);
                a_regs[q] = word;
            }
#pragma unroll
            for (int q = 0; q < B_VECS; ++q) {
                bool ok;
                const scalar_t* p = b_source(kt, q, ok);
                b_vecs[q] = ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
            }
        };
        auto store_tiles = [&](int s) {
            AMap::store(a_tile(s), tid, a_regs);
#pragma unroll
            for (int q = 0; q < B_VECS; ++q) *reinterpret_cast<uint4*>(b_slot(b_tile(s), q)) = b_vecs[q];
        };
        if (k_tiles > 0) {
            load_tiles(0);
            store_tiles(0);
            __syncthreads();
        }
        for (int kt = 0; kt < k_tiles; ++kt) {
            const int cur = kt & 1;
            if (kt + 1 < k_tiles) load_tiles(kt + 1);
            warp_tile_mma<KIND, MI, NI, B_K_PITCH>(acc, a_tile(cur), b_tile(cur), warp_row, warp_col, lane);
            if constexpr (KIND == MMA_3XTF32) promote(total, acc);
            if (kt + 1 < k_tiles) store_tiles(cur ^ 1);
            __syncthreads();
        }
    }

    const index_t dst_plane = H_DST * W_DST;
    const index_t dst_c_stride = DST_CL ? 1 : dst_plane;
    const index_t group_offset = static_cast<index_t>(g) * CG_N * dst_c_stride;
    scalar_t* dst_group = dst + group_offset;
    float* partial_group = reinterpret_cast<float*>(dst) + split * (N * dst_plane * C_DST) + group_offset;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = warp_row + mi * 16 + (lane >> 2) + h * 8;
            if (row_n[r] < 0) continue;
            const index_t pixel = (static_cast<index_t>(O_SH) * row_i[r] + rh) * W_DST + O_SW * row_j[r] + rw;
            const index_t at = row_n[r] * dst_plane * C_DST + (DST_CL ? pixel * C_DST : pixel);
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int n = n0 + warp_col + ni * 8 + (lane & 3) * 2 + q;
                    if (n >= CG_N) continue;
                    float v = pick_result<KIND>(acc, total)[mi][ni][h * 2 + q];
                    if constexpr (SPLIT_K > 1) {
                        partial_group[at + n * dst_c_stride] = v;
                    } else {
                        if constexpr (HAS_BIAS) v += load(bias + g * CG_N + n);
                        store(dst_group + at + n * dst_c_stride, v);
                    }
                }
        }
}
