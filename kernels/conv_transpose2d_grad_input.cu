// grad_input of a transposed convolution, which is the ordinary convolution
// conv2d(grad_output, weight, stride, padding, dilation, groups), as a gather.
//
// Each thread owns CELLS adjacent input pixels of one row and IC_BLOCK input
// channels of one group.  As in the forward kernel, the weights sit in shared
// memory as padded rows read with broadcast vector loads, and each grad_output
// row segment the CELLS pixels read is loaded once into a register window that
// all their taps share, so the inner loop is almost only multiply-adds.
#include "layer.cuh"
#include "direct.cuh"

constexpr int IC_BLOCK = {{IC_BLOCK}};  // input channels per thread
constexpr int CELLS = {{CELLS}};        // adjacent input pixels per thread
constexpr int OC_CHUNK = {{OC_CHUNK}};  // output channels whose weights are staged at a time
constexpr int BLOCK = {{BLOCK}};
constexpr int IC_BLOCKS = (CIN_G + IC_BLOCK - 1) / IC_BLOCK;
constexpr int VEC = SmemVector<acc_t>::WIDTH;
constexpr int ROW = (KW * IC_BLOCK + VEC - 1) / VEC * VEC;  // weights of one kernel row, [kw][i]
constexpr int RW = (CELLS - 1) * SW + (KW - 1) * DW + 1;    // grad_output columns the CELLS pixels read

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_input(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ w,
                            scalar_t* __restrict__ grad_in,
                            index_t N, index_t H, index_t W, index_t H_out, index_t W_out, index_t cells_w) {
    __shared__ __align__(16) acc_t ws[OC_CHUNK * KH * ROW];
    // Threads past the end stay to help stage weights, and neither load nor store.
    const index_t t = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x;
    const bool active = t < H * cells_w;
    const index_t ih = active ? t / cells_w : 0;
    const index_t iw = (active ? t % cells_w : 0) * CELLS;

    const Window<KH, RW, DH, 1> window(active, ih * SH - PH, H_out, iw * SW - PW, W_out);

    for (int icb = blockIdx.y; icb < GROUPS * IC_BLOCKS; icb += gridDim.y) {
        const int g = icb / IC_BLOCKS;
        const int icg0 = (icb % IC_BLOCKS) * IC_BLOCK;
        for (index_t n = blockIdx.z; n < N; n += gridDim.z) {
            acc_t acc[CELLS][IC_BLOCK] = {};

            const scalar_t* gg = grad_out + (n * COUT + g * COUT_G) * H_out * W_out;
            for (int oc0 = 0; oc0 < COUT_G; oc0 += OC_CHUNK) {
                stage_weight_rows<OC_CHUNK, IC_BLOCK, ROW, BLOCK>(ws, [&](int ocl, int i, int kh, int kw) {
                    const int ocg = oc0 + ocl, icg = icg0 + i;
                    return ocg < COUT_G && icg < CIN_G ? static_cast<acc_t>(load(w + weight_index(g * CIN_G + icg, ocg, kh, kw)))
                                                       : acc_t(0);
                });
                const int chunk = COUT_G - oc0 < OC_CHUNK ? COUT_G - oc0 : OC_CHUNK;
                for (int ocl = 0; ocl < chunk; ++ocl) {
                    const scalar_t* gc = gg + static_cast<index_t>(oc0 + ocl) * H_out * W_out;
                    // Apart from grad_input_nhwc.cu's tap loop: here one broadcast load brings a whole kernel row of weights.
                    window.for_each_row(gc, [&](const acc_t (&gv)[RW], int kh) {
                        acc_t wr[ROW];
                        load_smem_row(wr, ws + (ocl * KH + kh) * ROW);
#pragma unroll
                        for (int kw = 0; kw < KW; ++kw)
#pragma unroll
                            for (int c = 0; c < CELLS; ++c)
#pragma unroll
                                for (int i = 0; i < IC_BLOCK; ++i) acc[c][i] += gv[c * SW + kw * DW] * wr[kw * IC_BLOCK + i];
                    });
                }
            }

            if (!active) continue;
#pragma unroll
            for (int i = 0; i < IC_BLOCK; ++i) {
                if (icg0 + i >= CIN_G) continue;
                const index_t ic = static_cast<index_t>(g) * CIN_G + icg0 + i;
                scalar_t* dst = grad_in + ((n * CIN + ic) * H + ih) * W + iw;
#pragma unroll
                for (int c = 0; c < CELLS; ++c)
                    if (iw + c < W) store(dst + c, acc[c][i]);
            }
        }
    }
}
