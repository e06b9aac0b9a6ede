// Second pass of the deterministic split-K reductions (grad_weight, grad_bias, and the GEMMs'
// forward and grad_input): out[e] = sum over chunks c, in order, of partial[c][e], rounded once
// to the output dtype.  One thread per element keeps the summation order fixed.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef Accumulator<scalar_t>::type acc_t;
typedef {{INDEX_T}} index_t;

constexpr int BLOCK = {{BLOCK}};

__device__ __forceinline__ acc_t sum_chunks(const acc_t* __restrict__ partial, index_t e, index_t elements,
                                            index_t chunks) {
    acc_t s = acc_t(0);
    for (index_t c = 0; c < chunks; ++c) s += partial[c * elements + e];
    return s;
}

extern "C" __global__ void __launch_bounds__(BLOCK)
reduce_partials(const acc_t* __restrict__ partial, scalar_t* __restrict__ out, index_t elements, index_t chunks) {
    for (index_t e = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x; e < elements;
         e += static_cast<index_t>(gridDim.x) * BLOCK)
        store(out + e, sum_chunks(partial, e, elements, chunks));
}

// The split GEMMs' output: the bias of element e's channel, (e / channel_stride) % channels, is added after
// the chunks (as the unsplit kernels add it after their K loop); a null bias adds nothing.
extern "C" __global__ void __launch_bounds__(BLOCK)
reduce_partials_bias(const acc_t* __restrict__ partial, const scalar_t* __restrict__ bias, scalar_t* __restrict__ out,
                     index_t elements, index_t chunks, index_t channels, index_t channel_stride) {
    for (index_t e = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x; e < elements;
         e += static_cast<index_t>(gridDim.x) * BLOCK) {
        acc_t s = sum_chunks(partial, e, elements, chunks);
        if (bias != nullptr) s += acc_t(load(bias + e / channel_stride % channels));
        store(out + e, s);
    }
}

// Few elements and many chunks (a thin layer's grad_weight, split over hundreds of pixel ranges): one thread an
// element would leave most of the GPU idle, each thread walking every chunk in turn.  Here a block takes 32
// elements, its warp w adds chunks w, w + WARPS, ... in order, and the first warp adds the warps' sums in order:
// still a fixed order, so the result is bitwise reproducible.
constexpr int WARPS = BLOCK / 32;

extern "C" __global__ void __launch_bounds__(BLOCK)
reduce_partials_wide(const acc_t* __restrict__ partial, scalar_t* __restrict__ out, index_t elements, index_t chunks) {
    __shared__ acc_t sums[WARPS][32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const index_t e = static_cast<index_t>(blockIdx.x) * 32 + lane;
    acc_t s = acc_t(0);
    if (e < elements) {
#pragma unroll 4
        for (index_t c = warp; c < chunks; c += WARPS) s += partial[c * elements + e];
    }
    sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && e < elements) {
        acc_t total = acc_t(0);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += sums[w][lane];
        store(out + e, total);
    }
}
