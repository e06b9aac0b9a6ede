// Repacks a transposed-convolution weight (C_in, C_out/groups, kH, kW), contiguous or, with
// WEIGHT_CL, channels_last (memory (C_in, kH, kW, C_out/groups)), into the
// B operand layout of the implicit-GEMM kernels: packed[g][tap][n][k], k
// contiguous, n padded to N_PAD and k to K_PAD with zeros.  Every B tile is then
// BN rows of 64 contiguous bytes: 16-byte vector loads with no bounds tests.
//   MODE 0 (forward):    n = output channel, k = input channel
//   MODE 1 (grad_input): n = input channel,  k = output channel
// With TILE_N > 0 the same values are ordered tile by tile instead, as the wgmma kernels'
// bulk copies read them: [g][n tile][k chunk][tap][16-byte k group][n in tile][k in group],
// TILE_N x TILE_K per (n tile, k chunk, tap), each tile one contiguous block.
// ROUND_TF32 rounds fp32 values to TF32 (round to nearest, ties away), as the wgmma kernels, which
// read TF32 operands straight from shared memory, need.  SPLIT_TF32 (tiled order only) writes each
// tile twice over, for strict fp32's 3xTF32 wgmma kernels: the TF32 big parts, then right after them
// the small parts (split_tf32_bits), [g][n tile][k chunk][tap][part][...], so that one copy moves both.
//
// Either order is a transpose of the weight's: k and n trade places and the taps move out.  A
// block takes a region of REGION_K k by REGION_N n by every tap, which is a few long runs of the
// weight's memory, through shared memory: it reads the region in the weight's order and writes it
// in the packed order, so both sides move whole sectors (an element-wise gather read each 4-byte
// value of a sector in a different pass over the weight).  Regions lie inside one (n tile, k
// chunk) of the tiled order.  A region's (k, n) pairs sit in shared memory in the order the
// packed side walks them, each pair's taps a run of an odd length, so the stores' reads fall on
// distinct banks.  16-bit elements move two to a 4-byte word wherever both sides allow it (the
// packed side always does; the weight's side where its runs have even lengths and the pointer is
// word-aligned): a halfword a thread left each side's memory pipe at half the rate of fp32's.
#include "tf32_round.cuh"

typedef {{INDEX_T}} index_t;

constexpr int MODE = {{MODE}};
constexpr int ELEMENT_BYTES = {{ELEMENT_BYTES}};
constexpr int TAPS = {{TAPS}};
constexpr int GROUPS = {{GROUPS}};
constexpr int CIN_G = {{CIN_G}}, COUT_G = {{COUT_G}};
constexpr int N_PAD = {{N_PAD}}, K_PAD = {{K_PAD}};
constexpr int BLOCK = {{BLOCK}};
constexpr int TILE_N = {{TILE_N}}, TILE_K = {{TILE_K}};
constexpr int REGION_K = {{REGION_K}}, REGION_N = {{REGION_N}};
constexpr bool ROUND_TF32 = {{ROUND_TF32}};
constexpr bool SPLIT_TF32 = {{SPLIT_TF32}};
constexpr int PARTS = SPLIT_TF32 ? 2 : 1;
constexpr bool WEIGHT_CL = {{WEIGHT_CL}};
constexpr int VEC = 16 / ELEMENT_BYTES;
constexpr bool TILED = TILE_N > 0;
static_assert(!ROUND_TF32 || ELEMENT_BYTES == 4, "TF32 rounding of fp32 words");
static_assert(!SPLIT_TF32 || (ELEMENT_BYTES == 4 && !ROUND_TF32 && TILE_N > 0), "fp32 words split, tile by tile");
static_assert(!TILED || (N_PAD % TILE_N == 0 && K_PAD % TILE_K == 0 && TILE_K % VEC == 0), "whole tiles");
static_assert(!TILED || (TILE_N % REGION_N == 0 && TILE_K % REGION_K == 0 && REGION_K % VEC == 0),
              "regions inside one tile, of whole 16-byte k groups");
constexpr int CG_N = MODE == 0 ? COUT_G : CIN_G;
constexpr int CG_K = MODE == 0 ? CIN_G : COUT_G;
constexpr int TAP_RUN = TAPS | 1;   // a (k, n) pair's taps in shared memory, odd so pairs start on distinct banks
constexpr int REGION = REGION_K * REGION_N * TAPS;
constexpr int N_REGIONS = (N_PAD + REGION_N - 1) / REGION_N, K_REGIONS = (K_PAD + REGION_K - 1) / REGION_K;

// Only the bits move, so one kernel serves every dtype of a given width.
template <int BYTES> struct Bits;
template <> struct Bits<2> { typedef unsigned short type; };
template <> struct Bits<4> { typedef unsigned int type; };
typedef Bits<ELEMENT_BYTES>::type bits_t;

// The weight's memory runs along n (output channels) for MODE 0, k for MODE 1 in a channels_last weight, and
// along the taps in a contiguous one.
constexpr int INNER = MODE == 0 ? REGION_N : REGION_K;
// Elements a thread moves at once on each side: two 16-bit ones where their runs come in whole words.
constexpr int READ_UNIT = ELEMENT_BYTES == 2 && (WEIGHT_CL ? COUT_G % 2 == 0 && INNER % 2 == 0 : TAPS % 2 == 0) ? 2 : 1;
constexpr int WRITE_UNIT = ELEMENT_BYTES == 2 ? 2 : 1;
static_assert(WRITE_UNIT == 1 || (TILED ? VEC % 2 == 0 : REGION_K % 2 == 0 && K_PAD % 2 == 0), "whole words");
typedef Bits<ELEMENT_BYTES * WRITE_UNIT>::type write_t;

// Where the pair (kk, nn) of a region keeps its taps: in the order the packed side walks pairs.
__device__ __forceinline__ int pair_slot(int kk, int nn) {
    const int pair = TILED ? ((kk / VEC) * REGION_N + nn) * VEC + kk % VEC : nn * REGION_K + kk;
    return pair * TAP_RUN;
}

// Read: element e of a region, in the order of the weight's memory, is the pair (kk, nn)'s tap t; UNIT
// elements move at once, neighbours in memory that share a pair (a contiguous weight's taps) or a tap (a
// channels_last weight's output channels).
template <int UNIT>
__device__ __forceinline__ void read_unit(const bits_t* __restrict__ weight, bits_t* region, int e, int k0, int n0,
                                          int g) {
    typedef typename Bits<ELEMENT_BYTES * UNIT>::type unit_t;
    int inner, outer, t;
    if constexpr (WEIGHT_CL) {   // [ic][tap][oc]: output channels, then taps, then input channels
        inner = e % INNER;
        t = e / INNER % TAPS;
        outer = e / INNER / TAPS;
    } else {                     // [ic][oc][tap]: taps, then output channels, then input channels
        t = e % TAPS;
        inner = e / TAPS % INNER;
        outer = e / TAPS / INNER;
    }
    const int nn = MODE == 0 ? inner : outer, kk = MODE == 0 ? outer : inner;
    const int k = k0 + kk, n = n0 + nn;
    unit_t v = 0;
    if (n < CG_N && k < CG_K) {
        const int ic = MODE == 0 ? k : n, oc = MODE == 0 ? n : k;
        const index_t row = static_cast<index_t>(g) * CIN_G + ic;
        v = *reinterpret_cast<const unit_t*>(
            weight + (WEIGHT_CL ? (row * TAPS + t) * COUT_G + oc : (row * COUT_G + oc) * TAPS + t));
        if constexpr (ROUND_TF32) v = round_tf32_bits(v);
    }
    const int slot = pair_slot(kk, nn) + t;
    if constexpr (UNIT == 1) {
        region[slot] = v;
    } else {
        // the second element is the pair's next tap, or at this tap the next output channel's pair
        region[slot] = static_cast<bits_t>(v);
        region[!WEIGHT_CL ? slot + 1 : pair_slot(MODE == 0 ? kk : kk + 1, MODE == 0 ? nn + 1 : nn) + t] =
            static_cast<bits_t>(v >> 16);
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
pack_weight(const bits_t* __restrict__ weight, bits_t* __restrict__ packed) {
    __shared__ bits_t region[REGION_K * REGION_N * TAP_RUN];
    const int tid = threadIdx.x;
    const int k_region = blockIdx.x % K_REGIONS;
    const int n_region = blockIdx.x / K_REGIONS % N_REGIONS;
    const int g = blockIdx.x / K_REGIONS / N_REGIONS;
    const int k0 = k_region * REGION_K, n0 = n_region * REGION_N;

    // Consecutive threads take consecutive elements of the weight's memory, a word of two where it is aligned.
    if (READ_UNIT == 2 && reinterpret_cast<unsigned long long>(weight) % 4 == 0) {
        for (int e = READ_UNIT * tid; e < REGION; e += READ_UNIT * BLOCK)
            read_unit<READ_UNIT>(weight, region, e, k0, n0, g);
    } else {
        for (int e = tid; e < REGION; e += BLOCK) read_unit<1>(weight, region, e, k0, n0, g);
    }
    __syncthreads();

    // Write: consecutive threads take consecutive elements of the packed order, WRITE_UNIT neighbouring k
    // of one tap and n at once.
    auto word = [&](int kk, int nn, int t) {
        if constexpr (WRITE_UNIT == 1) return static_cast<write_t>(region[pair_slot(kk, nn) + t]);
        else return static_cast<write_t>(region[pair_slot(kk, nn) + t]
                                         | static_cast<write_t>(region[pair_slot(kk + 1, nn) + t]) << 16);
    };
    write_t* const out = reinterpret_cast<write_t*>(packed);
    if constexpr (TILED) {
        // [n tile][k chunk][tap][part][k group][n in tile][k in group]: per tap and k group, REGION_N x VEC in a row
        const int n_tile = n0 / TILE_N, chunk = k0 / TILE_K;
        const index_t tile_base = ((static_cast<index_t>(g) * (N_PAD / TILE_N) + n_tile) * (K_PAD / TILE_K) + chunk)
                                  * TAPS * PARTS * TILE_K * TILE_N;
        const int n_in0 = n0 % TILE_N, group0 = k0 % TILE_K / VEC;
        for (int e = WRITE_UNIT * tid; e < REGION; e += WRITE_UNIT * BLOCK) {
            const int in_group = e % VEC, nn = e / VEC % REGION_N;
            const int kg = e / (VEC * REGION_N) % (REGION_K / VEC), t = e / (REGION_N * REGION_K);
            const index_t at = tile_base + ((static_cast<index_t>(t) * PARTS * (TILE_K / VEC) + group0 + kg) * TILE_N
                                            + n_in0 + nn) * VEC + in_group;
            const write_t v = word(kg * VEC + in_group, nn, t);
            if constexpr (SPLIT_TF32) {
                const Tf32Parts parts = split_tf32_bits(v);
                out[at] = parts.big;
                out[at + TILE_K * TILE_N] = parts.small;
            } else {
                out[at / WRITE_UNIT] = v;
            }
        }
    } else {
        // [tap][n][k]: per tap and n, REGION_K in a row
        for (int e = WRITE_UNIT * tid; e < REGION; e += WRITE_UNIT * BLOCK) {
            const int kk = e % REGION_K, nn = e / REGION_K % REGION_N, t = e / (REGION_K * REGION_N);
            const int k = k0 + kk, n = n0 + nn;
            if (k < K_PAD && n < N_PAD)
                out[(((static_cast<index_t>(g) * TAPS + t) * N_PAD + n) * K_PAD + k) / WRITE_UNIT] = word(kk, nn, t);
        }
    }
}
