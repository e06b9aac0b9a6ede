// Transposed-convolution forward for kernels of any size, as a gather by stride phase.
//
// Output row oh is phase rh = (oh + PH) % SH of cell q = (oh + PH) / SH.  Only taps with
// (kh * DH) % SH == rh reach it: kh = k0 + j * (SH / gcd(SH, DH)), and tap j reads input
// row q - (k0 * DH - rh) / SH - j * (DH / gcd(SH, DH)) (columns likewise).  So within one
// phase the forward is a plain correlation over the phase's own taps, and each block
// takes one phase (blockIdx.x / tiles) and a patch of its cells: every tap its threads
// visit contributes, and they all visit the same taps, one staged tile at a time.  Only
// phases that hold outputs get blocks: along an axis of stride S with n outputs, the
// min(S, n) phases from P % S on.
#include "layer.cuh"
#include "large_kernel.cuh"

constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int GH = Gcd<SH, DH>::value, GW = Gcd<SW, DW>::value;

struct Pass {
    static constexpr bool CHANNELS_LAST = {{CHANNELS_LAST}};
    static constexpr int OCB = {{OCB}};            // adjacent output channels per thread
    static constexpr int LANES = {{LANES}};        // threads along channels (1 in NCHW)
    static constexpr int RUNS = {{RUNS}};          // threads along pixels
    static constexpr int TILE_W = {{TILE_W}};      // cell columns of a block
    static constexpr int CELLS = {{CELLS}};        // adjacent cells of one column per thread
    static constexpr int TJ = {{TJ}}, TI = {{TI}};  // phase taps staged at a time, along h and w
    static constexpr int SRC_CHUNK = {{SRC_CHUNK}};  // input channels staged at a time
    static constexpr int DST_CH = COUT, DST_G = COUT_G, SRC_CH = CIN, SRC_G = CIN_G;
    typedef Axis<SH, 1, -(DH / GH), SH / GH> AxisH;
    typedef Axis<SW, 1, -(DW / GW), SW / GW> AxisW;

    // Output channel d, input channel s of its group.
    static __device__ __forceinline__ index_t weight(int d, int s, int kh, int kw) {
        return weight_index(static_cast<index_t>(d / COUT_G) * CIN_G + s, d % COUT_G, kh, kw);
    }
};

// Phase r of an axis of stride S, dilation D, padding P_ and kernel size K, whose output
// has out_size positions and input in_size.
template <class A, int S, int D, int P_, int K>
__device__ __forceinline__ A phase_axis(int r, index_t out_size, index_t in_size) {
    constexpr int STEP = S / Gcd<S, D>::value;
    A a;
    // The phase's first tap; a later one would start at k0 + STEP, past every tap of its own.
    int k0 = -1;
#pragma unroll 1
    for (int k = 0; k < STEP && k < K; ++k)
        if (static_cast<long long>(k) * D % S == r) {
            k0 = k;
            break;
        }
    // Cells q whose output q * S + r - P_ lies in [0, out_size).
    const index_t q0 = ceil_div(static_cast<index_t>(P_) - r, S);
    const index_t q1 = floor_div(out_size - 1 + P_ - r, S) + 1;
    a.count = max_of(q1 - q0, index_t(0));
    a.dst0 = q0 * S + r - P_;
    a.size = in_size;
    a.k0 = k0 < 0 ? 0 : k0;
    a.taps = k0 < 0 ? 0 : (K - k0 + STEP - 1) / STEP;
    a.src0 = k0 < 0 ? 0 : q0 - (static_cast<index_t>(k0) * D - r) / S;
    return a;
}

// Four blocks an SM: at most 128 registers a thread, which the planned tilings fit without spilling.
extern "C" __global__ void __launch_bounds__(Pass::LANES * Pass::RUNS, 4)
conv_transpose2d_large_kernel_forward(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                                      const scalar_t* __restrict__ bias, scalar_t* __restrict__ y,
                                      index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                                      index_t tiles_h, index_t tiles_w) {
    const index_t tiles = tiles_h * tiles_w;
    const index_t b = blockIdx.x;
    const index_t phase = b / tiles, tile = b % tiles;
    const index_t phases_w = min_of(static_cast<index_t>(SW), W_out);
    const int rh = static_cast<int>((PH % SH + static_cast<long long>(phase / phases_w)) % SH);
    const int rw = static_cast<int>((PW % SW + static_cast<long long>(phase % phases_w)) % SW);
    const Pass::AxisH ah = phase_axis<Pass::AxisH, SH, DH, PH, KH>(rh, H_out, H);
    const Pass::AxisW aw = phase_axis<Pass::AxisW, SW, DW, PW, KW>(rw, W_out, W);
    // A phase that no tap reaches gets the bias alone.
    gather<Pass>(x, w, y, ah, aw, N, H_out, W_out, tile / tiles_w, tile % tiles_w, [&](int d) {
        return HAS_BIAS ? static_cast<acc_t>(load(bias + d)) : acc_t(0);
    });
}
