// Second pass of the deterministic split-K reductions (grad_weight, grad_bias, and the GEMMs'
// forward and grad_input): out[e] = sum over chunks c, in order, of partial[c][e], rounded once
// to the output dtype.  One thread adds each element's chunks, which keeps their order fixed.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef Accumulator<scalar_t>::type acc_t;
typedef {{INDEX_T}} index_t;

constexpr int BLOCK = {{BLOCK}};
constexpr int VEC = {{VEC}};   // the run of elements a thread adds (reduce_partials_wide takes 1)
static_assert(VEC == 1 || (VEC == 4 && sizeof(acc_t) == 4), "single elements, or runs of four fp32 partials");

__device__ __forceinline__ acc_t sum_chunks(const acc_t* __restrict__ partial, index_t e, index_t elements,
                                            index_t chunks) {
    acc_t s = acc_t(0);
    for (index_t c = 0; c < chunks; ++c) s += partial[c * elements + e];
    return s;
}

// VEC 4: elements is a multiple of four and the partials are fp32, so a thread adds runs of four elements with
// 16-byte loads of the (256-byte aligned) scratch, several chunks' loads in flight at once; each element's chunks
// are still added in order.  A pass over a large weight gradient is bound by the bytes in flight.
__device__ __forceinline__ void sum_run(const acc_t* __restrict__ run, index_t elements, index_t chunks,
                                        float (&s)[4]) {
    s[0] = s[1] = s[2] = s[3] = 0.0f;
#pragma unroll 4
    for (index_t c = 0; c < chunks; ++c) {
        const float4 q = __ldg(reinterpret_cast<const float4*>(run + c * elements));
        s[0] += q.x;
        s[1] += q.y;
        s[2] += q.z;
        s[3] += q.w;
    }
}

// Every element's chunks added in order (VEC 1: an element a thread; VEC 4: runs of four) over a grid-stride
// loop, and finish(e, sum) stored to out[e]: the one place both reduces below walk their elements.
template <typename Finish>
__device__ __forceinline__ void reduce_elements(const acc_t* __restrict__ partial, scalar_t* __restrict__ out,
                                                index_t elements, index_t chunks, Finish finish) {
    if constexpr (VEC == 1) {
        for (index_t e = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x; e < elements;
             e += static_cast<index_t>(gridDim.x) * BLOCK)
            store(out + e, finish(e, sum_chunks(partial, e, elements, chunks)));
    } else {
        const index_t runs = elements / VEC;
        for (index_t r = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x; r < runs;
             r += static_cast<index_t>(gridDim.x) * BLOCK) {
            float s[4];
            sum_run(partial + r * VEC, elements, chunks, s);
#pragma unroll
            for (int j = 0; j < 4; ++j) store(out + r * VEC + j, finish(r * VEC + j, s[j]));
        }
    }
}

extern "C" __global__ void __launch_bounds__(BLOCK)
reduce_partials(const acc_t* __restrict__ partial, scalar_t* __restrict__ out, index_t elements, index_t chunks) {
    reduce_elements(partial, out, elements, chunks, [](index_t, acc_t s) { return s; });
}

// The split GEMMs' output: the bias of element e's channel, (e / channel_stride) % channels, is added after
// the chunks (as the unsplit kernels add it after their K loop); a null bias adds nothing.
extern "C" __global__ void __launch_bounds__(BLOCK)
reduce_partials_bias(const acc_t* __restrict__ partial, const scalar_t* __restrict__ bias, scalar_t* __restrict__ out,
                     index_t elements, index_t chunks, index_t channels, index_t channel_stride) {
    reduce_elements(partial, out, elements, chunks, [=](index_t e, acc_t s) {
        return bias != nullptr ? s + acc_t(load(bias + e / channel_stride % channels)) : s;
    });
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
