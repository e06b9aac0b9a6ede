// grad_input of a transposed convolution for kernels of any size: the ordinary strided
// convolution of grad_output, as a gather,
//     grad_in[n, ic, ih, iw] = sum over the output channels oc of ic's group and taps kh, kw of
//         grad_out[n, oc, ih*SH - PH + kh*DH, iw*SW - PW + kw*DW] * w[ic, oc % COUT_G, kh, kw]
// with out-of-range rows and columns skipped.  Each block takes a patch of input pixels;
// the weights pass through shared memory one tile of taps at a time (large_kernel.cuh).
#include "layer.cuh"
#include "large_kernel.cuh"

struct Pass {
    static constexpr bool CHANNELS_LAST = {{CHANNELS_LAST}};
    static constexpr int OCB = {{OCB}};            // adjacent input channels per thread
    static constexpr int LANES = {{LANES}};        // threads along channels (1 in NCHW)
    static constexpr int RUNS = {{RUNS}};          // threads along pixels
    static constexpr int TILE_W = {{TILE_W}};      // pixel columns of a block
    static constexpr int CELLS = {{CELLS}};        // adjacent pixels of one column per thread
    static constexpr int TJ = {{TJ}}, TI = {{TI}};  // taps staged at a time, along h and w
    static constexpr int SRC_CHUNK = {{SRC_CHUNK}};  // output channels staged at a time
    static constexpr int DST_CH = CIN, DST_G = CIN_G, SRC_CH = COUT, SRC_G = COUT_G;
    typedef Axis<1, SH, DH, 1> AxisH;
    typedef Axis<1, SW, DW, 1> AxisW;

    // Input channel d, output channel s of its group.
    static __device__ __forceinline__ index_t weight(int d, int s, int kh, int kw) {
        return weight_index(d, s, kh, kw);
    }
};

// Four blocks an SM: at most 128 registers a thread, which the planned tilings fit without spilling.
extern "C" __global__ void __launch_bounds__(Pass::LANES * Pass::RUNS, 4)
conv_transpose2d_large_kernel_grad_input(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ w,
                                         scalar_t* __restrict__ grad_in,
                                         index_t N, index_t H, index_t W, index_t H_out, index_t W_out,
                                         index_t tiles_h, index_t tiles_w) {
    const index_t b = blockIdx.x;
    const Pass::AxisH ah = {H, 0, -PH, H_out, 0, KH};
    const Pass::AxisW aw = {W, 0, -PW, W_out, 0, KW};
    gather<Pass>(grad_out, w, grad_in, ah, aw, N, H, W, b / tiles_w, b % tiles_w, [](int) { return acc_t(0); });
}
