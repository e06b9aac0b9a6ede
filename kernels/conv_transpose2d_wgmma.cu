// Forward and grad_input of a transposed convolution on Hopper's warpgroup MMA (wgmma,
// sm_90a), with every source pixel brought into shared memory once per tile and read
// there by all the taps.  Both gather from a source ("src") into a destination ("dst"):
//   forward (MODE 0): src = x, dst = y, one stride phase per grid z.  Output rows
//     oh = SH*i + rh of phase (rh, rw) read input rows i + dh for the taps whose
//     (rh + PH - kh*DH) is a multiple of SH, dh being that quotient; columns likewise.
//   grad_input (MODE 1): src = grad_out, dst = grad_in, a strided conv2d: grad_in row i
//     reads grad_out rows SH*i - PH + kh*DH for every tap.
// A tile is TILE_IMAGES x TILE_H x TILE_W pixels of the destination (phase) grid and BN
// destination channels.  For each chunk of CK source channels the tile's source "halo"
// goes into shared memory as [image][row phase][column phase][halo row][halo column], each
// pixel a swizzled 128-byte row (a chunk of 128 bytes) or else a 16-byte slot of one plane
// per channel group: source row r0 + SPLIT_H*a + ph lands in row phase ph, row a (SPLIT_H
// is 1 for the forward, SH for grad_input), and likewise for columns.  Eight neighbouring
// destination pixels then read eight consecutive halo pixels of one phase plane, which is
// one core matrix (row group) of the A operand, a halo row apart from the next eight;
// so each tap is the same buffer read from a moved origin: one descriptor change per tap
// and no gather.  A one-row patch (TILE_H 1: 1-D layers, grids of few rows) takes 64
// pixels of its row as an MMA block instead, its core matrices eight pixels apart, so no
// MMA row falls past a grid only a row or two high.  B is the weight, packed by
// pack_weight.cu as one contiguous CK x BN tile per (n tile, chunk, tap), copied whole by
// the copy engine; or, in 16 bits, a channels_last weight read in place (WEIGHT_DIRECT), whose
// memory runs (C_in, KH, KW, C_out / GROUPS): per tap its output channels are contiguous, so the
// forward's B (K = input channels, N = output channels) is an MN-major operand and grad_input's
// (K = output channels) a K-major one.  The forward's lands by cp.async as 128-byte swizzled rows
// (a k's 64 output channels), grad_input's as such rows too (an n's 64 K channels) where its chunk
// is 64 channels, else in the pack's planes.  That saves the pack's launch and its pass over the
// weight.
//
// With SPLIT_K > 1 a block takes one of SPLIT_K even ranges of the input-channel chunks (grid z is
// phase x SPLIT_K) and writes fp32 partial sums, without the bias, into dst reinterpreted as
// [SPLIT_K][the destination's elements] in the destination's layout; reduce_partials.cu adds them
// in order.  A small grid of wide channels makes fewer tiles than SMs, each walking a long K alone:
// splitting K brings the idle SMs, and their share of the weight's bandwidth, in.
//
// Where the plan gives a tensor map of the source (TMA), one producer thread has the copy engine copy each
// halo instead, a box per image and phase plane walked at SPLIT_H x SPLIT_W, swizzled 128 bytes and zero
// outside the source; each plane then starts on a whole swizzle period (PLANE_BYTES).
//
// The block is persistent over the tiles of its (channel tile, phase) and split by role:
// the last warpgroup produces (cp.async for the halos, a bulk copy per packed weight tile or
// cp.async for one read in place, each completing on a "full" mbarrier), the others consume (wgmma, one step in flight, then an
// arrival on the "empty" mbarrier that lets the producer refill the buffer).  The producer
// runs ahead across tiles, so the next tile's halo and weights land while this tile's
// MMAs and stores run.  The source is channels_last with 16-byte channel groups (an NCHW
// source is copied into that form first); the destination may be either layout.
// fp32 runs as TF32 (MMA_KIND 2), rounded to nearest, since wgmma would drop the low bits
// unrounded: pack_weight rounds the weight, and the channels_last copy of an NCHW source rounds
// the source (SRC_ROUNDED).  A source read in place is rounded by the producer, which must then
// wait for each halo to land before it hands it over, so its copies no longer run ahead.
// Strict fp32 (MMA_KIND 3) runs as 3xTF32: every operand buffer holds the TF32 big parts followed
// by their TF32 residuals (split_tf32_bits; pack_weight writes the weight's, the producer splits
// each halo once it lands), and each MMA step is small x big + big x small + big x big.  Tensor-core
// accumulation is not rounded to nearest, so as in the mma.sync kernels a step's sum is moved into
// an ordinary fp32 total when the step's MMAs finish, before the next step starts.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"
#include "mbarrier_copy.cuh"

constexpr int MODE = {{MODE}};
constexpr int KIND = {{MMA_KIND}};
constexpr bool SPLIT_TF32 = KIND == MMA_3XTF32;
constexpr bool TF32 = KIND == MMA_TF32 || SPLIT_TF32;
constexpr int MMA = SPLIT_TF32 ? MMA_TF32 : KIND;   // what each wgmma multiplies
constexpr int TILE_IMAGES = {{TILE_IMAGES}}, TILE_H = {{TILE_H}}, TILE_W = {{TILE_W}};
constexpr int CONSUMERS = {{WARPGROUPS}};   // warpgroups doing MMAs; one more produces
constexpr int BN = {{BN}};
constexpr int CK = {{CK}};                   // input channels per chunk
constexpr int B_STAGES = {{B_STAGES}}, HALO_STAGES = {{HALO_STAGES}};
constexpr int HALO_H = {{HALO_H}}, HALO_W = {{HALO_W}};   // one phase plane of the widest phase's halo
constexpr bool DST_CL = {{DST_CL}};
constexpr bool HAS_BIAS = {{HAS_BIAS}} && MODE == 0;
constexpr bool SRC_ROUNDED = {{SRC_ROUNDED}};   // TF32: the source's words are already rounded
constexpr bool WEIGHT_DIRECT = {{WEIGHT_DIRECT}};   // B straight from a channels_last weight, not a packed copy
constexpr int SPLIT_K = {{SPLIT_K}};                // K ranges (of whole chunks) over grid z
constexpr bool TMA = {{TMA}};                       // the copy engine copies the halos (src_map)

constexpr int CG_K = MODE == 0 ? CIN_G : COUT_G;   // source channels per group: the GEMM's K per tap
constexpr int CG_N = MODE == 0 ? COUT_G : CIN_G;   // destination channels per group: its N
constexpr int C_SRC = CG_K * GROUPS, C_DST = CG_N * GROUPS;
constexpr int SPLIT_H = MODE == 0 ? 1 : SH, SPLIT_W = MODE == 0 ? 1 : SW;   // halo phase planes
constexpr int O_SH = MODE == 0 ? SH : 1, O_SW = MODE == 0 ? SW : 1;         // destination pixel steps

constexpr int THREADS = 128 * (CONSUMERS + 1);
constexpr int VEC = 16 / sizeof(scalar_t);     // channels in one 16-byte core-matrix row
constexpr int K_STEP = 32 / sizeof(scalar_t);  // channels one wgmma consumes
constexpr int CHUNK_GROUPS = CK / VEC;
constexpr int CHUNKS = (CG_K + CK - 1) / CK;
constexpr int N_TILES = (CG_N + BN - 1) / BN;
constexpr int N_PAD = N_TILES * BN, K_PAD = CHUNKS * CK;   // packed weight: [GROUPS][n tile][chunk][tap][CK x BN]
constexpr int SPLIT_CHUNKS = (CHUNKS + SPLIT_K - 1) / SPLIT_K;   // chunks of one K range
constexpr int BM = TILE_IMAGES * TILE_H * TILE_W;
constexpr int M_BLOCKS = BM / 64;                          // 64-row MMA blocks
constexpr int MB = M_BLOCKS / CONSUMERS;                   // per consumer warpgroup
constexpr int BLOCK_ROWS = TILE_H == 1 ? 1 : 8, BLOCK_COLS = 64 / BLOCK_ROWS;   // a block's patch rows x columns
constexpr int COL_BLOCKS = TILE_W / BLOCK_COLS, IMAGE_BLOCKS = TILE_H / BLOCK_ROWS * COL_BLOCKS;
constexpr int PHASE_PLANE = HALO_H * HALO_W;
constexpr int IMAGE_HALO = SPLIT_H * SPLIT_W * PHASE_PLANE;
constexpr int HALO_PIXELS = TILE_IMAGES * IMAGE_HALO;
// A chunk of 128 bytes a pixel lands as one 128-byte row per halo pixel in the 128-byte swizzle
// (wgmma.cuh): a pixel's channel run is then one row and its copies coalesce.  Narrower chunks
// (few channels) land as channel-group planes, each an odd number of 16-byte pixels so that the
// eight groups one pixel's copies write fall on different banks.
constexpr bool SWIZZLED = CK * sizeof(scalar_t) == 128;
constexpr int PIXEL_BYTES = SWIZZLED ? 128 : 16;   // from one halo pixel to the next
constexpr int HALO_PLANE = SWIZZLED ? 0 : (HALO_PIXELS | 1) * 16;
// Bytes from one phase plane of an image's halo to the next, and from one image's halo to the next: the copy
// engine's boxes each start on a whole swizzle period.
constexpr int PLANE_BYTES = TMA ? (PHASE_PLANE * 128 + 1023) / 1024 * 1024 : PHASE_PLANE * PIXEL_BYTES;
constexpr int IMAGE_BYTES = SPLIT_H * SPLIT_W * PLANE_BYTES;
constexpr int HALO_BYTES = SWIZZLED ? TILE_IMAGES * IMAGE_BYTES : CHUNK_GROUPS * HALO_PLANE;
constexpr unsigned TMA_HALO_BYTES = HALO_PIXELS * 128;   // what the boxes of one halo land
constexpr int B_PLANE = BN * 16;
constexpr int B_BYTES = CHUNK_GROUPS * B_PLANE;
// 3xTF32 buffers hold two parts each: the big one, then the small one HALO_BYTES or B_BYTES after it.
constexpr int PARTS = SPLIT_TF32 ? 2 : 1;
constexpr int HALO_STAGE_BYTES = PARTS * HALO_BYTES, B_STAGE_BYTES = PARTS * B_BYTES;
constexpr int HALO_VECS = CHUNK_GROUPS * HALO_PIXELS;
// A weight read in place: the forward's B tile is BN / 64 column blocks of CK rows (input channels) of 128
// bytes (64 output channels); grad_input's is BN rows (input channels) of 128 bytes (64 output channels, the
// whole chunk).  16-byte vectors along a copied row, and each producer thread's share of a tile.
constexpr bool B_MN_MAJOR = WEIGHT_DIRECT && MODE == 0;
constexpr bool B_SWIZZLED = WEIGHT_DIRECT && (MODE == 0 || CK * sizeof(scalar_t) == 128);
constexpr int B_ROW_VECS = B_MN_MAJOR ? BN / VEC : CK / VEC;
constexpr int B_COPIES = CK * BN / VEC / 128;
constexpr int B_COLUMN_BLOCK = CK * 128;   // MN-major: bytes from one 64-channel column block to the next
// The halos come first; a directly read weight's buffers start on a whole swizzle period after them.
constexpr int HALO_REGION = WEIGHT_DIRECT ? (HALO_STAGES * HALO_BYTES + 1023) / 1024 * 1024
                                          : HALO_STAGES * HALO_STAGE_BYTES;
// Bytes from one core matrix (eight pixels) of an MMA block to the next along M: the next
// halo row of an 8 x 8 block, the next eight pixels of a one-row block.
constexpr int A_CORE_STRIDE = (BLOCK_ROWS == 8 ? HALO_W : 8) * PIXEL_BYTES;
// Where the 16-byte channel group `group` of halo pixel `pixel` lands in a halo at `halo`.
__device__ __forceinline__ unsigned halo_vector(unsigned halo, int pixel, int group) {
    if constexpr (SWIZZLED) return swizzle_128b(halo + pixel * 128 + group * 16);
    return halo + group * HALO_PLANE + pixel * 16;
}
// Registers move from the producer to the consumers (setmaxnreg) when there are two of
// them: 56 + 2 x 224 per thread-triple fills the register file.
constexpr int PRODUCER_REGISTERS = 56, CONSUMER_REGISTERS = 224;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16 || (TF32 && sizeof(scalar_t) == 4),
              "fp16, bf16, or fp32 as TF32 or 3xTF32");
static_assert(TILE_W % BLOCK_COLS == 0 && TILE_H % BLOCK_ROWS == 0 && M_BLOCKS % CONSUMERS == 0,
              "whole 64-row MMA blocks per warpgroup");
static_assert(CK % K_STEP == 0 && CG_K % VEC == 0, "chunks of whole MMA steps, channels in whole 16-byte groups");
static_assert(B_STAGES >= 2 && HALO_STAGES >= 1, "pipeline depths");
static_assert(SPLIT_K >= 1 && SPLIT_K <= CHUNKS, "K ranges of one chunk or more");
static_assert(HALO_REGION + B_STAGES * B_STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");
static_assert(!TMA || (SWIZZLED && !SPLIT_TF32 && (!TF32 || SRC_ROUNDED)),
              "the copy engine lands 128-byte rows that the producer need not round or split");
static_assert(!WEIGHT_DIRECT || (WEIGHT_CL && !TF32 && COUT_G % VEC == 0 && CK * BN % (VEC * 128) == 0
                                 && (MODE == 1 || BN % 64 == 0)),
              "a weight read in place: channels_last, 16 bits, whole 16-byte output channel runs, whole copy rounds, "
              "the forward's N in 64-channel column blocks");

struct Tap { int offset, w; };   // byte offset of the tap's origin in an image's halo; weight tap

// What the epilogue stores: the destination's type, or a split block's fp32 partials.
template <bool PARTIALS> struct Stored { typedef scalar_t type; };
template <> struct Stored<true> { typedef float type; };
typedef Stored<(SPLIT_K > 1)>::type out_t;

// A producer thread's share of the B tile of (group g, n tile n0, chunk c, weight tap `tap`) from a channels_last
// weight read in place, into the buffer at `slot` (WEIGHT_DIRECT); output channels past the layer's, and input
// channels past its group's, land as zeros.  A thread keeps one place along the copied rows and steps over rows,
// and the loop stays rolled: the producer runs on few registers, and unrolled, its 64-bit addresses spilled.
constexpr int B_ROW_STEP = 128 / B_ROW_VECS;   // rows from one of a thread's copies to the next
static_assert(!WEIGHT_DIRECT || 128 % B_ROW_VECS == 0, "a thread's copies stay at one place along the rows");
__device__ __forceinline__ void copy_weight_tile(unsigned slot, const scalar_t* weight, int g, int n0, int c, int tap,
                                                 int ptid) {
    const int along = ptid % B_ROW_VECS * VEC, row0 = ptid / B_ROW_VECS;   // channel offset along a row; first row
    // MN-major (forward): row = input channel c * CK + row, along = output channels n0 + along.
    // K-major (grad_input): row = input channel n0 + row, along = output channels c * CK + along.
    const int ic0 = (B_MN_MAJOR ? c * CK : n0) + row0, ocg = (B_MN_MAJOR ? n0 : c * CK) + along;
    const scalar_t* p = weight + weight_index(static_cast<index_t>(g) * CIN_G + ic0, ocg, tap);
    unsigned at = !B_SWIZZLED ? slot + along / VEC * B_PLANE + row0 * 16
                  : B_MN_MAJOR ? slot + along / 64 * B_COLUMN_BLOCK + row0 * 128 + along % 64 * 2
                               : slot + row0 * 128 + along * 2;
    constexpr index_t P_STEP = static_cast<index_t>(B_ROW_STEP) * TAPS * COUT_G;   // the next row's input channel
    constexpr unsigned AT_STEP = B_ROW_STEP * (B_SWIZZLED ? 128 : 16);
#pragma unroll 1
    for (int q = 0, ic = ic0; q < B_COPIES; ++q, ic += B_ROW_STEP, p += P_STEP, at += AT_STEP) {
        const bool ok = ic < CIN_G && ocg < COUT_G;
        cp_async_16(B_SWIZZLED ? swizzle_128b(at) : at, ok ? p : weight, ok);
    }
}

// Where tile `tile` of the phase grid starts; false for a tile past this phase's grid.
struct TileOrigin {
    index_t image, i, j;
};

#if {{TMA}}
#define TENSOR_MAPS , const __grid_constant__ TensorMap src_map
#else
#define TENSOR_MAPS
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1)
conv_transpose2d_wgmma(const scalar_t* __restrict__ src, const scalar_t* __restrict__ packed_weight,
                               const scalar_t* __restrict__ bias, scalar_t* __restrict__ dst,
                               index_t N, index_t H_SRC, index_t W_SRC, index_t H_DST, index_t W_DST TENSOR_MAPS) {
    extern __shared__ __align__(128) unsigned char smem[];   // HALO_STAGES halos, then B_STAGES weight tiles
    __shared__ Tap taps[TAPS];
    __shared__ int tap_count, min_dh, min_dw;
    __shared__ __align__(8) unsigned long long halo_full[HALO_STAGES], halo_empty[HALO_STAGES];
    __shared__ __align__(8) unsigned long long b_full[B_STAGES], b_empty[B_STAGES];

    const int tid = threadIdx.x;
    const int phase = static_cast<int>(blockIdx.z) / SPLIT_K, split = static_cast<int>(blockIdx.z) % SPLIT_K;
    const int rh = phase / O_SW, rw = phase % O_SW;
    // This block's input-channel chunks [c_first, c_end): a range of K for every tap of the phase.
    const int c_first = min(CHUNKS, split * SPLIT_CHUNKS), c_end = min(CHUNKS, c_first + SPLIT_CHUNKS);
    const index_t MH = rh < H_DST ? (H_DST - rh + O_SH - 1) / O_SH : 0;   // this phase's grid
    const index_t MW = rw < W_DST ? (W_DST - rw + O_SW - 1) / O_SW : 0;
    const index_t tiles_w = ((W_DST + O_SW - 1) / O_SW + TILE_W - 1) / TILE_W;   // phase 0's grid, the largest
    const index_t tiles_h = ((H_DST + O_SH - 1) / O_SH + TILE_H - 1) / TILE_H;
    const index_t tile_count = (N + TILE_IMAGES - 1) / TILE_IMAGES * tiles_h * tiles_w;
    const int g = blockIdx.y / N_TILES;
    const int n0 = (blockIdx.y % N_TILES) * BN;
    // Both roles walk the same tiles in the same order and skip the same ones.
    auto origin = [&](index_t tile, TileOrigin& o) {
        o.image = tile / (tiles_w * tiles_h) * TILE_IMAGES;
        o.i = (tile / tiles_w % tiles_h) * TILE_H;
        o.j = tile % tiles_w * TILE_W;
        return o.i < MH && o.j < MW;
    };

    if (tid == 0 && MODE == 1) {
        // Tap (kh, kw) reads halo row SH*u + kh*DH of the tile's row u: phase plane
        // (kh*DH % SH, kw*DW % SW), shifted by (kh*DH / SH, kw*DW / SW).
        for (int kh = 0; kh < KH; ++kh)
            for (int kw = 0; kw < KW; ++kw) {
                const int plane = (kh * DH % SH) * SW + kw * DW % SW;
                taps[kh * KW + kw] =
                    Tap{plane * PLANE_BYTES + (kh * DH / SH * HALO_W + kw * DW / SW) * PIXEL_BYTES, kh * KW + kw};
            }
        tap_count = TAPS;
        min_dh = -PH;   // the halo starts at source row SH*i0 - PH
        min_dw = -PW;
    } else if (tid == 0) {
        // Two passes: the halo's origin is the smallest tap offset of the phase.
        int lo_h = 1 << 30, lo_w = 1 << 30;
        for (int pass = 0; pass < 2; ++pass) {
            int count = 0;
            for (int kh = 0; kh < KH; ++kh) {
                const int th = rh + PH - kh * DH;
                if (th % SH != 0) continue;
                for (int kw = 0; kw < KW; ++kw) {
                    const int tw = rw + PW - kw * DW;
                    if (tw % SW != 0) continue;
                    if (pass == 0) {
                        lo_h = min(lo_h, th / SH);
                        lo_w = min(lo_w, tw / SW);
                    } else {
                        taps[count] = Tap{((th / SH - lo_h) * HALO_W + tw / SW - lo_w) * PIXEL_BYTES, kh * KW + kw};
                    }
                    ++count;
                }
            }
            tap_count = count;
        }
        min_dh = lo_h;
        min_dw = lo_w;
    }
    if (tid == 0) {
        for (int s = 0; s < HALO_STAGES; ++s) {
            mbarrier_init(smem_addr(&halo_full[s]), TMA ? 1 : 128);   // the copy engine's, or every thread's
            mbarrier_init(smem_addr(&halo_empty[s]), CONSUMERS);
        }
        for (int s = 0; s < B_STAGES; ++s) {
            // the expecting arrival, then the bytes; or every producer thread's copies of a weight read in place
            mbarrier_init(smem_addr(&b_full[s]), WEIGHT_DIRECT ? 128 : 1);
            mbarrier_init(smem_addr(&b_empty[s]), CONSUMERS);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    const int tap_n = tap_count;
    // the copy engine's swizzle counts from whole swizzle periods (the plan leaves room to align)
    const unsigned smem_base = TMA ? (smem_addr(smem) + 1023) & ~1023u : smem_addr(smem);
    auto halo_slot = [&](int h) { return smem_base + (h % HALO_STAGES) * HALO_STAGE_BYTES; };
    auto b_slot = [&](int b) { return smem_base + HALO_REGION + (b % B_STAGES) * B_STAGE_BYTES; };
    const int warpgroup = tid / 128;

    if (warpgroup == CONSUMERS) {
        // ------------------------------------------------------------------ producer
        if constexpr (CONSUMERS > 1) registers_release<PRODUCER_REGISTERS>();
        const int ptid = tid % 128;
        const index_t src_batch = H_SRC * W_SRC * C_SRC;
        const scalar_t* w_tiles = packed_weight + (static_cast<index_t>(g) * N_PAD + n0) * TAPS * K_PAD * PARTS;
        int h_iter = 0, b_iter = 0;
        for (index_t tile = blockIdx.x; tile < tile_count; tile += gridDim.x) {
            TileOrigin o;
            if (!origin(tile, o)) continue;
            const scalar_t* src_group = src + o.image * src_batch + static_cast<index_t>(g) * CG_K;
            const index_t halo_i0 = SPLIT_H * o.i + min_dh, halo_j0 = SPLIT_W * o.j + min_dw;
            for (int c = c_first; c < c_end && tap_n > 0; ++c, ++h_iter) {
                const unsigned full = smem_addr(&halo_full[h_iter % HALO_STAGES]);
                const unsigned halo = halo_slot(h_iter);
#if {{TMA}}
                if (ptid == 0) {
                    mbarrier_wait(smem_addr(&halo_empty[h_iter % HALO_STAGES]), ((h_iter / HALO_STAGES) & 1) ^ 1);
                    mbarrier_expect_bytes(full, TMA_HALO_BYTES);
                    const int channel = g * CG_K + c * CK;
                    for (int image = 0; image < TILE_IMAGES; ++image)
                        for (int plane = 0; plane < SPLIT_H * SPLIT_W; ++plane)
                            tensor_copy_4d(halo + image * IMAGE_BYTES + plane * PLANE_BYTES, src_map, channel,
                                           static_cast<int>(halo_j0) + plane % SPLIT_W,
                                           static_cast<int>(halo_i0) + plane / SPLIT_W,
                                           static_cast<int>(o.image) + image, full);
                }
#else
                mbarrier_wait(smem_addr(&halo_empty[h_iter % HALO_STAGES]), ((h_iter / HALO_STAGES) & 1) ^ 1);
                auto copy_vector = [&](int v) {
                    const int group = v % CHUNK_GROUPS, pixel = v / CHUNK_GROUPS;
                    const int image = pixel / IMAGE_HALO, at = pixel % IMAGE_HALO;
                    const int plane = at / PHASE_PLANE, in_plane = at % PHASE_PLANE;
                    const index_t ih = halo_i0 + SPLIT_H * (in_plane / HALO_W) + plane / SPLIT_W;
                    const index_t iw = halo_j0 + SPLIT_W * (in_plane % HALO_W) + plane % SPLIT_W;
                    const int k = c * CK + group * VEC;
                    const bool ok = o.image + image < N && ih >= 0 && ih < H_SRC && iw >= 0 && iw < W_SRC
                                    && k < CG_K;
                    const scalar_t* p = ok ? src_group + image * src_batch + (ih * W_SRC + iw) * C_SRC + k : src;
                    cp_async_16(halo_vector(halo, pixel, group), p, ok);
                };
                if constexpr (BLOCK_ROWS == 1) {
                    // A one-row halo's few vectors a thread: ptxas unrolled their loop whole and spilled.
#pragma unroll 2
                    for (int v = ptid; v < HALO_VECS; v += 128) copy_vector(v);
                } else {
                    for (int v = ptid; v < HALO_VECS; v += 128) copy_vector(v);
                }
                if constexpr (TF32 && !SRC_ROUNDED) {
                    // The tensor cores would truncate fp32 words; each thread rounds (or splits) the vectors it
                    // copied once they land, before its arrival hands the halo to the MMAs (the async proxy).
                    cp_async_commit();
                    cp_async_wait<0>();
                    for (int v = ptid; v < HALO_VECS; v += 128) {
                        const int pixel = v / CHUNK_GROUPS, group = v % CHUNK_GROUPS;
                        if constexpr (SPLIT_TF32)
                            split_shared_tf32(halo_vector(halo, pixel, group),
                                              halo_vector(halo + HALO_BYTES, pixel, group));
                        else
                            round_shared_tf32(halo_vector(halo, pixel, group));
                    }
                    fence_async_shared();
                    mbarrier_arrive(full);
                } else {
                    cp_async_arrive(full);
                }
#endif
                for (int t = 0; t < tap_n; ++t, ++b_iter) {
                    if constexpr (WEIGHT_DIRECT) {
                        mbarrier_wait(smem_addr(&b_empty[b_iter % B_STAGES]), ((b_iter / B_STAGES) & 1) ^ 1);
                        copy_weight_tile(b_slot(b_iter), packed_weight, g, n0, c, taps[t].w, ptid);
                        cp_async_arrive(smem_addr(&b_full[b_iter % B_STAGES]));
                    } else if (ptid == 0) {
                        const unsigned bar = smem_addr(&b_full[b_iter % B_STAGES]);
                        mbarrier_wait(smem_addr(&b_empty[b_iter % B_STAGES]), ((b_iter / B_STAGES) & 1) ^ 1);
                        mbarrier_expect_bytes(bar, B_STAGE_BYTES);
                        bulk_copy(b_slot(b_iter),
                                  w_tiles + (static_cast<index_t>(c) * TAPS + taps[t].w) * CK * BN * PARTS,
                                  B_STAGE_BYTES, bar);
                    }
                }
            }
        }
        cp_async_wait<0>();
        return;
    }

    // ---------------------------------------------------------------------- consumers
    if constexpr (CONSUMERS > 1) registers_claim<CONSUMER_REGISTERS>();
    // Byte offset of each of this warpgroup's 64-row blocks in a halo plane.
    unsigned block_offset[MB];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
        const int b = warpgroup * MB + mb, at = b % IMAGE_BLOCKS;
        block_offset[mb] = b / IMAGE_BLOCKS * IMAGE_BYTES
                           + ((at / COL_BLOCKS) * BLOCK_ROWS * HALO_W + (at % COL_BLOCKS) * BLOCK_COLS) * PIXEL_BYTES;
    }
    const bool signals = tid % 128 == 0;   // one arrival per warpgroup on the "empty" barriers
    const int lane = tid % 32, warp = tid % 128 / 32;
    const index_t dst_plane = H_DST * W_DST;
    float acc[MB][BN / 2];
    float total[MB][BN / 2];   // 3xTF32: the steps' sums, added in fp32
    // A split block stores its range's fp32 partials, dst seen as [SPLIT_K][the destination's elements] of float,
    // through the same indexing as an unsplit block's outputs.
    out_t* const split_dst = SPLIT_K > 1 ? reinterpret_cast<out_t*>(dst) + split * (N * dst_plane * C_DST)
                                         : reinterpret_cast<out_t*>(dst);
    int h_iter = 0, b_iter = 0;
    for (index_t tile = blockIdx.x; tile < tile_count; tile += gridDim.x) {
        TileOrigin o;
        if (!origin(tile, o)) continue;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[mb][i] = total[mb][i] = 0.f;
        // The step whose MMAs may still run: its weight buffer, and its halo if it was its chunk's last tap.
        int pending_b = -1, pending_h = -1;
        for (int c = c_first; c < c_end && tap_n > 0; ++c, ++h_iter) {
            mbarrier_wait(smem_addr(&halo_full[h_iter % HALO_STAGES]), (h_iter / HALO_STAGES) & 1);
            fence_async_shared();   // the halo came through cp.async (the generic proxy); wgmma reads it async
            const unsigned halo = halo_slot(h_iter);
            for (int t = 0; t < tap_n; ++t, ++b_iter) {
                mbarrier_wait(smem_addr(&b_full[b_iter % B_STAGES]), (b_iter / B_STAGES) & 1);
                const unsigned a_origin = halo + taps[t].offset, b_origin = b_slot(b_iter);
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < CK / K_STEP; ++kk) {
                    // B's 32 bytes of K: two planes of the packed tile; 16 rows (two groups of eight) of an
                    // MN-major one; 32 bytes into a K-major one's swizzled rows.
                    const unsigned long long b_desc =
                        !B_SWIZZLED ? smem_descriptor(b_origin + 2 * kk * B_PLANE, B_PLANE, 128)
                        : B_MN_MAJOR ? smem_descriptor_swizzle_128b(b_origin + kk * 2048, B_COLUMN_BLOCK, 1024)
                                     : smem_descriptor_swizzle_128b(b_origin + kk * 32, 16, 1024);
#pragma unroll
                    for (int mb = 0; mb < MB; ++mb) {
                        // An MMA's 32 bytes of K: two channel-group planes, or 32 bytes into the rows.
                        const unsigned a_at = a_origin + block_offset[mb];
                        auto a_descriptor = [&](unsigned at) {
                            return SWIZZLED ? smem_descriptor_swizzle_128b(at + kk * 32, 16, A_CORE_STRIDE)
                                            : smem_descriptor(at + 2 * kk * HALO_PLANE, HALO_PLANE, A_CORE_STRIDE);
                        };
                        const unsigned long long a_desc = a_descriptor(a_at);
                        if constexpr (SPLIT_TF32) {
                            // Small cross terms first, so they are not lost against the big product; each step
                            // starts its sum afresh.
                            const unsigned long long b_small = b_desc + (B_BYTES >> 4);
                            wgmma_async<MMA, BN>(acc[mb], a_descriptor(a_at + HALO_BYTES), b_desc, kk > 0);
                            wgmma_async<MMA, BN>(acc[mb], a_desc, b_small, 1);
                        }
                        wgmma_async<MMA, BN, 0, B_MN_MAJOR>(acc[mb], a_desc, b_desc, 1);
                    }
                }
                wgmma_commit();
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
                if constexpr (SPLIT_TF32) {
                    // This step's MMAs done: its sum joins the total, and its buffers go back at once.
                    wgmma_wait<0>();
#pragma unroll
                    for (int mb = 0; mb < MB; ++mb) {
                        fence_registers(acc[mb]);
#pragma unroll
                        for (int i = 0; i < BN / 2; ++i) total[mb][i] += acc[mb][i];
                    }
                    if (signals) {
                        mbarrier_arrive(smem_addr(&b_empty[b_iter % B_STAGES]));
                        if (t == tap_n - 1) mbarrier_arrive(smem_addr(&halo_empty[h_iter % HALO_STAGES]));
                    }
                    continue;
                }
                wgmma_wait<1>();   // the previous step's MMAs are done: release its buffers
                if (signals && pending_b >= 0) {
                    mbarrier_arrive(smem_addr(&b_empty[pending_b]));
                    if (pending_h >= 0) mbarrier_arrive(smem_addr(&halo_empty[pending_h]));
                }
                pending_b = b_iter % B_STAGES;
                pending_h = t == tap_n - 1 ? h_iter % HALO_STAGES : -1;
            }
        }
        wgmma_wait<0>();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
        if (signals && pending_b >= 0) {
            mbarrier_arrive(smem_addr(&b_empty[pending_b]));
            if (pending_h >= 0) mbarrier_arrive(smem_addr(&halo_empty[pending_h]));
        }

        // Stores straight from the accumulators, while the producer fills the next tile's buffers.
        out_t* dst_group = split_dst + o.image * dst_plane * C_DST
                           + static_cast<index_t>(g) * CG_N * (DST_CL ? 1 : dst_plane);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
            const int b = warpgroup * MB + mb, at = b % IMAGE_BLOCKS;
            const index_t image = b / IMAGE_BLOCKS;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp * 16 + lane / 4 + h * 8;   // row of the 64-row block
                const index_t i = o.i + (at / COL_BLOCKS) * BLOCK_ROWS + r / BLOCK_COLS;
                const index_t j = o.j + (at % COL_BLOCKS) * BLOCK_COLS + r % BLOCK_COLS;
                if (o.image + image >= N || i >= MH || j >= MW) continue;
                const index_t pixel = (O_SH * i + rh) * W_DST + O_SW * j + rw;
                out_t* out = dst_group + image * dst_plane * C_DST + (DST_CL ? pixel * C_DST : pixel);
#pragma unroll
                for (int jn = 0; jn < BN / 8; ++jn) {
                    const int oc = n0 + jn * 8 + (lane % 4) * 2;
                    const float(&sum)[BN / 2] = SPLIT_TF32 ? total[mb] : acc[mb];
                    float v0 = sum[jn * 4 + h * 2], v1 = sum[jn * 4 + h * 2 + 1];
                    if constexpr (HAS_BIAS && SPLIT_K == 1) {
                        if (oc < CG_N) v0 += load(bias + g * CG_N + oc);
                        if (oc + 1 < CG_N) v1 += load(bias + g * CG_N + oc + 1);
                    }
                    if constexpr (DST_CL && CG_N % 2 == 0) {
                        // Channel pairs are whole words (the pointers are 16-byte aligned; a range's fp32 partials
                        // start a whole number of pairs in, the channels being even).
                        if (oc < CG_N) store_pair(out + oc, v0, v1);
                    } else {
                        if (oc < CG_N) store(out + oc * (DST_CL ? 1 : dst_plane), v0);
                        if (oc + 1 < CG_N) store(out + (oc + 1) * (DST_CL ? 1 : dst_plane), v1);
                    }
                }
            }
        }
    }
}
