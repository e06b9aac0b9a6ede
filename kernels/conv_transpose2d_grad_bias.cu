// grad_bias = grad_out.sum((0, 2, 3)), first pass of a deterministic split-K:
// blockIdx.x takes a fixed chunk of the values of one channel (NCHW) or of the pixels
// of a tile of channels (channels_last) and writes one partial per channel;
// reduce_partials.cu adds the chunks in a fixed order.  A single chunk writes grad_bias itself.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef Accumulator<scalar_t>::type acc_t;
typedef {{INDEX_T}} index_t;

constexpr int COUT = {{COUT}};
constexpr bool CHANNELS_LAST = {{CHANNELS_LAST}};
constexpr int BLOCK = {{BLOCK}};
constexpr int CHANNEL_TILE = {{CHANNEL_TILE}};  // channels_last: channels of a block, at most BLOCK
// Values a thread reads at once: one 16-byte load of a run of channels (channels_last) or of one plane
// (NCHW), where the planner found the runs whole and grad_out 16-byte aligned; else 1.
constexpr int VEC = {{VEC}};
constexpr int UNROLL = {{UNROLL}};  // loads a thread keeps in flight
constexpr int WARPS = BLOCK / 32;
constexpr bool SINGLE_CHUNK = {{SINGLE_CHUNK}};
typedef PartialOut<SINGLE_CHUNK, scalar_t, acc_t>::type partial_t;
// Sums run in fp64 for every dtype: grad_bias adds up a whole output whose values often
// mostly cancel, where fp32 sums of a few hundred values already lose several roundings
// of the result, and this pass is bound by memory, so the wider adds cost nothing.
typedef double sum_t;

static_assert(!CHANNELS_LAST || CHANNEL_TILE % VEC == 0, "a channels_last tile holds whole runs");

// VEC neighbouring channels of one pixel (channels_last) or values of one plane (NCHW), as stored.
typedef Run<scalar_t, VEC> ChannelRun;

__device__ __forceinline__ void add_run(const ChannelRun& run, sum_t (&acc)[VEC]) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += static_cast<sum_t>(widen(run.v[i]));
}

// NCHW: a thread's next run, STEP values on along a channel's planes strung together, as (image, place in
// the plane), with STEP = step_images planes and step_rest values.
__device__ __forceinline__ void next_run(index_t& n, index_t& within, index_t step_images, index_t step_rest,
                                         index_t hw) {
    within += step_rest;
    n += step_images;
    if (within >= hw) {
        within -= hw;
        ++n;
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
conv_transpose2d_grad_bias_partial(const scalar_t* __restrict__ grad_out, partial_t* __restrict__ partial,
                                   index_t N, index_t H_out, index_t W_out, index_t per_chunk) {
    if constexpr (CHANNELS_LAST) {
        // Threads are (pixel lane, channel run) with the run fastest: a warp reads whole
        // channel runs of adjacent pixels, and a layer with few channels still keeps every
        // thread busy.  Each thread sums every PIXEL_LANES-th pixel of the chunk in pixel
        // order, UNROLL loads in flight; then the lanes' sums are added in lane order, by
        // segments of lanes and then the segments in order: a fixed order throughout.
        constexpr int CHANNEL_RUNS = CHANNELS_LAST ? CHANNEL_TILE / VEC : 1;  // (an NCHW kernel still parses this)
        constexpr int PIXEL_LANES = BLOCK / CHANNEL_RUNS;
        constexpr int SEGMENTS = BLOCK / CHANNEL_TILE;
        constexpr int LANES_PER_SEGMENT = (PIXEL_LANES + SEGMENTS - 1) / SEGMENTS;
        __shared__ sum_t lane_sums[PIXEL_LANES][CHANNEL_TILE];
        __shared__ sum_t segment_sums[SEGMENTS][CHANNEL_TILE];
        const int run = threadIdx.x % CHANNEL_RUNS;
        const int pixel_lane = threadIdx.x / CHANNEL_RUNS;
        const int tile_c = threadIdx.x % CHANNEL_TILE;
        const int segment = threadIdx.x / CHANNEL_TILE;
        const index_t pixels = N * H_out * W_out;
        const index_t p0 = static_cast<index_t>(blockIdx.x) * per_chunk;  // per_chunk counts pixels here
        const index_t p1 = p0 + per_chunk < pixels ? p0 + per_chunk : pixels;
        for (index_t c0 = static_cast<index_t>(blockIdx.y) * CHANNEL_TILE; c0 < COUT;
             c0 += static_cast<index_t>(gridDim.y) * CHANNEL_TILE) {
            const index_t c = c0 + run * VEC;
            sum_t acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = 0.0;
            // COUT is a whole number of runs, so a run lies wholly inside or outside the channels.
            if (pixel_lane < PIXEL_LANES && c < COUT) {
                index_t p = p0 + pixel_lane;
                for (; p + (UNROLL - 1) * PIXEL_LANES < p1; p += UNROLL * PIXEL_LANES) {
                    ChannelRun runs[UNROLL];
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u)
                        runs[u] = load_run<VEC>(grad_out + (p + u * PIXEL_LANES) * COUT + c);
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u) add_run(runs[u], acc);
                }
                for (; p < p1; p += PIXEL_LANES) add_run(load_run<VEC>(grad_out + p * COUT + c), acc);
            }
            if (pixel_lane < PIXEL_LANES) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) lane_sums[pixel_lane][run * VEC + i] = acc[i];
            }
            __syncthreads();
            if (segment < SEGMENTS) {
                const int first = segment * LANES_PER_SEGMENT;
                const int last = first + LANES_PER_SEGMENT < PIXEL_LANES ? first + LANES_PER_SEGMENT : PIXEL_LANES;
                sum_t s = first < last ? lane_sums[first][tile_c] : 0.0;
                for (int l = first + 1; l < last; ++l) s += lane_sums[l][tile_c];
                segment_sums[segment][tile_c] = s;
            }
            __syncthreads();
            if (threadIdx.x < CHANNEL_TILE && c0 + threadIdx.x < COUT) {
                sum_t s = segment_sums[0][threadIdx.x];
                for (int k = 1; k < SEGMENTS; ++k) s += segment_sums[k][threadIdx.x];
                store(partial + static_cast<index_t>(blockIdx.x) * COUT + c0 + threadIdx.x, static_cast<acc_t>(s));
            }
            __syncthreads();
        }
        return;
    }
    // NCHW: channel oc of image n is one contiguous plane of HW values, so the channel's values, the planes
    // strung together, are a virtual array whose value e lies at (e / HW) * COUT * HW + oc * HW + e % HW.
    // per_chunk counts its values here (whole runs of VEC): a block sums chunk blockIdx.x of it, its threads
    // BLOCK runs apart, stepping (image, place in the plane) without dividing.
    __shared__ sum_t warp_partials[WARPS];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const index_t hw = H_out * W_out;
    const index_t values = N * hw;
    const index_t e0 = static_cast<index_t>(blockIdx.x) * per_chunk;
    const index_t e1 = e0 + per_chunk < values ? e0 + per_chunk : values;
    constexpr index_t STEP = static_cast<index_t>(BLOCK) * VEC;
    const index_t step_images = STEP / hw, step_rest = STEP % hw;
    const index_t image_stride = static_cast<index_t>(COUT) * hw;
    for (int oc = blockIdx.y; oc < COUT; oc += gridDim.y) {
        const scalar_t* planes = grad_out + static_cast<index_t>(oc) * hw;
        sum_t acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.0;
        index_t e = e0 + static_cast<index_t>(threadIdx.x) * VEC;
        index_t n = e / hw, within = e % hw;
        for (; e + (UNROLL - 1) * STEP < e1; e += UNROLL * STEP) {
            ChannelRun runs[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                runs[u] = load_run<VEC>(planes + n * image_stride + within);
                next_run(n, within, step_images, step_rest, hw);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) add_run(runs[u], acc);
        }
        for (; e < e1; e += STEP) {
            add_run(load_run<VEC>(planes + n * image_stride + within), acc);
            next_run(n, within, step_images, step_rest, hw);
        }
        sum_t s = acc[0];
#pragma unroll
        for (int i = 1; i < VEC; ++i) s += acc[i];
        s = warp_sum(s);
        if (lane == 0) warp_partials[warp] = s;
        __syncthreads();
        if (threadIdx.x == 0) {
            sum_t total = warp_partials[0];
#pragma unroll
            for (int k = 1; k < WARPS; ++k) total += warp_partials[k];
            store(partial + static_cast<index_t>(blockIdx.x) * COUT + oc, static_cast<acc_t>(total));
        }
        __syncthreads();
    }
}
