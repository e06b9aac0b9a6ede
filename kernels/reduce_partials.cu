// Second pass of the deterministic split-K reductions (grad_weight, grad_bias):
// out[e] = sum over chunks c, in order, of partial[c][e], rounded once to the
// output dtype.  One thread per element keeps the summation order fixed.
#include "common.cuh"

typedef {{SCALAR_T}} scalar_t;
typedef Accumulator<scalar_t>::type acc_t;
typedef {{INDEX_T}} index_t;

constexpr int BLOCK = {{BLOCK}};

extern "C" __global__ void __launch_bounds__(BLOCK)
reduce_partials(const acc_t* __restrict__ partial, scalar_t* __restrict__ out, index_t elements, index_t chunks) {
    for (index_t e = static_cast<index_t>(blockIdx.x) * BLOCK + threadIdx.x; e < elements;
         e += static_cast<index_t>(gridDim.x) * BLOCK) {
        acc_t s = acc_t(0);
        for (index_t c = 0; c < chunks; ++c) s += partial[c * elements + e];
        store(out + e, s);
    }
}
