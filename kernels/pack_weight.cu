// Repacks a transposed-convolution weight (C_in, C_out/groups, kH, kW) into the
// B operand layout of the implicit-GEMM kernels: packed[g][tap][n][k], k
// contiguous, n padded to N_PAD and k to K_PAD with zeros.  Every B tile is then
// BN rows of 64 contiguous bytes: 16-byte vector loads with no bounds tests.
//   MODE 0 (forward):    n = output channel, k = input channel
//   MODE 1 (grad_input): n = input channel,  k = output channel
typedef {{INDEX_T}} index_t;

constexpr int MODE = {{MODE}};
constexpr int ELEMENT_BYTES = {{ELEMENT_BYTES}};
constexpr int TAPS = {{TAPS}};
constexpr int GROUPS = {{GROUPS}};
constexpr int CIN_G = {{CIN_G}}, COUT_G = {{COUT_G}};
constexpr int N_PAD = {{N_PAD}}, K_PAD = {{K_PAD}};
constexpr int BLOCK = {{BLOCK}};
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
        const int k = static_cast<int>(e % K_PAD);
        const int n = static_cast<int>((e / K_PAD) % N_PAD);
        const int t = static_cast<int>((e / (static_cast<index_t>(K_PAD) * N_PAD)) % TAPS);
        const int g = static_cast<int>(e / (static_cast<index_t>(K_PAD) * N_PAD * TAPS));
        bits_t v = 0;
        if (n < CG_N && k < CG_K) {
            const int ic = MODE == 0 ? k : n, oc = MODE == 0 ? n : k;
            v = weight[((static_cast<index_t>(g) * CIN_G + ic) * COUT_G + oc) * TAPS + t];
        }
        packed[e] = v;
    }
}
