// grad_bias = grad_out.sum((0, 2, 3)), first pass of a deterministic split-K:
// blockIdx.x takes a fixed chunk of the (n, oh) rows of one channel (NCHW) or of
// the pixels of a tile of channels (channels_last) and writes one partial per channel;
// reduce_partials.cu adds the chunks in a fixed order.  A single chunk writes grad_bias itself.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef Accumulator<scalar_t>::type acc_t;
typedef {{INDEX_T}} index_t;

constexpr int COUT = {{COUT}};
constexpr bool CHANNELS_LAST = {{CHANNELS_LAST}};
constexpr int BLOCK = {{BLOCK}};
constexpr int CHANNEL_TILE = {{CHANNEL_TILE}};  // channels_last: channels of a block, at most BLOCK
constexpr int WARPS = BLOCK / 32;
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
typedef PartialOut<SINGLE_CHUNK, scalar_t, acc_t>::type partial_t;
// Sums run in fp64 for every dtype: grad_bias adds up a whole output whose values often
// mostly cancel, where fp32 sums of a few hundred values already lose several roundings
// of the result, and this pass is bound by memory, so the wider adds cost nothing.
typedef double sum_t;

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_bias_partial(const scalar_t* __restrict__ grad_out, partial_t* __restrict__ partial,
                                   index_t N, index_t H_out, index_t W_out, index_t rows_per_chunk) {
    if constexpr (CHANNELS_LAST) {
        // Threads are (pixel lane, channel) with the channel fastest: a warp reads
        // whole channel runs of adjacent pixels, and a layer with few channels still
        // keeps every thread busy.  Each thread sums every PIXEL_LANES-th pixel of the
        // chunk, then the lanes' sums are added in lane order: a fixed order throughout.
        constexpr int PIXEL_LANES = BLOCK / CHANNEL_TILE;
        __shared__ sum_t lane_sums[PIXEL_LANES][CHANNEL_TILE];
        const int lane_c = threadIdx.x % CHANNEL_TILE;
        const int pixel_lane = threadIdx.x / CHANNEL_TILE;
        const index_t pixels = N * H_out * W_out;
        const index_t p0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
        const index_t p1 = p0 + rows_per_chunk < pixels ? p0 + rows_per_chunk : pixels;
        for (index_t c0 = static_cast<index_t>(blockIdx.y) * CHANNEL_TILE; c0 < COUT;
             c0 += static_cast<index_t>(gridDim.y) * CHANNEL_TILE) {
            const index_t c = c0 + lane_c;
            sum_t acc[4] = {0.0, 0.0, 0.0, 0.0};
            if (pixel_lane < PIXEL_LANES && c < COUT) {
                index_t p = p0 + pixel_lane;
                for (; p + 3 * PIXEL_LANES < p1; p += 4 * PIXEL_LANES)
#pragma unroll
                    for (int u = 0; u < 4; ++u)
                        acc[u] += static_cast<sum_t>(load(grad_out + (p + u * PIXEL_LANES) * COUT + c));
                for (; p < p1; p += PIXEL_LANES) acc[0] += static_cast<sum_t>(load(grad_out + p * COUT + c));
            }
            if (pixel_lane < PIXEL_LANES) lane_sums[pixel_lane][lane_c] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
            __syncthreads();
            if (pixel_lane == 0 && c < COUT) {
                sum_t s = lane_sums[0][lane_c];
                for (int l = 1; l < PIXEL_LANES; ++l) s += lane_sums[l][lane_c];
                store(partial + static_cast<index_t>(blockIdx.x) * COUT + c, static_cast<acc_t>(s));
            }
            __syncthreads();
        }
        return;
    }
    __shared__ sum_t warp_partials[WARPS];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const index_t rows = N * H_out;
    const index_t r0 = static_cast<index_t>(blockIdx.x) * rows_per_chunk;
    const index_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    for (int oc = blockIdx.y; oc < COUT; oc += gridDim.y) {
        sum_t acc = 0.0;
        for (index_t r = r0 + warp; r < r1; r += WARPS) {
            const index_t n = r / H_out;
            const index_t oh = r % H_out;
            const scalar_t* row = grad_out + ((n * COUT + oc) * H_out + oh) * W_out;
            for (index_t ow = lane; ow < W_out; ow += 32) acc += static_cast<sum_t>(load(row + ow));
        }
        acc = warp_sum(acc);
        if (lane == 0) warp_partials[warp] = acc;
        __syncthreads();
        if (threadIdx.x == 0) {
            sum_t s = 0.0;
#pragma unroll
            for (int k = 0; k < WARPS; ++k) s += warp_partials[k];
            store(partial + static_cast<index_t>(blockIdx.x) * COUT + oc, static_cast<acc_t>(s));
        }
        __syncthreads();
    }
}
