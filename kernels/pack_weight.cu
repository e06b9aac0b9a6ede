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
// read TF32 operands straight from shared memory, need.
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
constexpr bool ROUND_TF32 = {{ROUND_TF32}};
constexpr bool WEIGHT_CL = {{WEIGHT_CL}};
constexpr int VEC = 16 / ELEMENT_BYTES;
static_assert(!ROUND_TF32 || ELEMENT_BYTES == 4, "TF32 rounding of fp32 words");
static_assert(TILE_N == 0 || (N_PAD % TILE_N == 0 && K_PAD % TILE_K == 0 && TILE_K % VEC == 0), "whole tiles");
constexpr int CG_N = MODE == 0 ? COUT_G : CIN_G;
constexpr int CG_K = MODE == 0 ? CIN_G : COUT_G;

// Only the bits move, so one kernel serves every dtype of a given width.
template <int BYTES> struct Bits;
template <> struct Bits<2> { typedef unsigned short type; };
template <> struct Bits<4> { typedef unsigned int type; };
typedef Bits<ELEMENT_BYTES>::type bits_t;

extern "C" __global__ void __launch_bounds__(BLOCK)
pack_weight(const bits_t* __restrict__ weight, bits_t* __restrict__ packed) {
    constexpr index_t TOTAL = static_cast<index_t>(GROUPS) * TAPS * N_PAD * K_PAD;
    for (index_t e = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x; e < TOTAL;
         e += static_cast<index_t>(gridDim.x) * BLOCK) {
        int k, n, t, g;
        if constexpr (TILE_N > 0) {
            index_t rest = e;
            const int in_group = static_cast<int>(rest % VEC); rest /= VEC;
            const int n_in = static_cast<int>(rest % TILE_N); rest /= TILE_N;
            const int k_group = static_cast<int>(rest % (TILE_K / VEC)); rest /= TILE_K / VEC;
            t = static_cast<int>(rest % TAPS); rest /= TAPS;
            const int chunk = static_cast<int>(rest % (K_PAD / TILE_K)); rest /= K_PAD / TILE_K;
            const int n_tile = static_cast<int>(rest % (N_PAD / TILE_N));
            g = static_cast<int>(rest / (N_PAD / TILE_N));
            n = n_tile * TILE_N + n_in;
            k = chunk * TILE_K + k_group * VEC + in_group;
        } else {
            k = static_cast<int>(e % K_PAD);
            n = static_cast<int>((e / K_PAD) % N_PAD);
            t = static_cast<int>((e / (static_cast<index_t>(K_PAD) * N_PAD)) % TAPS);
            g = static_cast<int>(e / (static_cast<index_t>(K_PAD) * N_PAD * TAPS));
        }
        bits_t v = 0;
        if (n < CG_N && k < CG_K) {
            const int ic = MODE == 0 ? k : n, oc = MODE == 0 ? n : k;
            const index_t row = static_cast<index_t>(g) * CIN_G + ic;
            v = weight[WEIGHT_CL ? (row * TAPS + t) * COUT_G + oc : (row * COUT_G + oc) * TAPS + t];
            if constexpr (ROUND_TF32) v = round_tf32_bits(v);
        }
        packed[e] = v;
    }
}
