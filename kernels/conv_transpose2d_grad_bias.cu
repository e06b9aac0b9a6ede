// grad_bias = grad_out.sum((0, 2, 3)), first pass of a deterministic split-K:
// blockIdx.x takes a fixed chunk of the (n, oh) rows of one channel (NCHW) or of
// the pixels of every channel (channels_last) and writes one partial per channel;
// reduce_partials.cu adds the chunks in a fixed order.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef {{ACC_T}} acc_t;
typedef {{INDEX_T}} index_t;

constexpr int COUT = {{COUT}};
constexpr bool CHANNELS_LAST = {{CHANNELS_LAST}};
constexpr int BLOCK = {{BLOCK}};
constexpr int WARPS = BLOCK / 32;

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_bias_partial(const scalar_t* __restrict__ grad_out, acc_t* __restrict__ partial,
                                   index_t N, index_t H_out, index_t W_out, index_t rows_per_chunk) {
    if constexpr (CHANNELS_LAST) {
        // One thread per channel walks the chunk's pixels: a warp reads 32 adjacent
        // channels of one pixel per step, and each sum keeps a fixed order.
        const index_t pixels = N * H_out * W_out;
        const index_t p0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
        const index_t p1 = p0 + rows_per_chunk < pixels ? p0 + rows_per_chunk : pixels;
        for (index_t c = static_cast<index_t>(blockIdx.y) * BLOCK + threadIdx.x; c < COUT;
             c += static_cast<index_t>(gridDim.y) * BLOCK) {
            acc_t acc[4] = {acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
            index_t p = p0;
            for (; p + 4 <= p1; p += 4)
#pragma unroll
                for (int u = 0; u < 4; ++u) acc[u] += static_cast<acc_t>(load(grad_out + (p + u) * COUT + c));
            for (; p < p1; ++p) acc[0] += static_cast<acc_t>(load(grad_out + p * COUT + c));
            partial[static_cast<index_t>(blockIdx.x) * COUT + c] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
        return;
    }
    __shared__ acc_t warp_partials[WARPS];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const index_t rows = N * H_out;
    const index_t r0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
    const index_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    for (int oc = blockIdx.y; oc < COUT; oc += gridDim.y) {
        acc_t acc = acc_t(0);
        for (index_t r = r0 + warp; r < r1; r += WARPS) {
            const index_t n = r / H_out;
            const index_t oh = r % H_out;
            const scalar_t* row = grad_out + ((n * COUT + oc) * H_out + oh) * W_out;
            for (index_t ow = lane; ow < W_out; ow += 32) acc += static_cast<acc_t>(load(row + ow));
        }
        acc = warp_sum(acc);
        if (lane == 0) warp_partials[warp] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            acc_t s = acc_t(0);
#pragma unroll
            for (int k = 0; k < WARPS; ++k) s += warp_partials[k];
            partial[static_cast<index_t>(blockIdx.x) * COUT + oc] = s;
        }
        __syncthreads();
    }
}
