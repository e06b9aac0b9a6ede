// An fp32 activation copied into scratch with its words rounded to TF32 (tf32_round.cuh), layout unchanged.
// A channels_last source read in place reaches the wgmma kernels unrounded, so their producer rounds every halo
// vector in shared memory and the copy engine cannot land it; an NCHW source's channels_last copy rounds on the
// way. This copy gives a channels_last source the same path, for one more pass over it in memory.
//
// Both pointers are 16-byte aligned (the wgmma kernels' halos need as much); a thread moves UNROLL 16-byte
// vectors a step, all loads issued before the first store, and the last words % 4 move one by one.
#include "tf32_round.cuh"

typedef {{INDEX_T}} index_t;
constexpr int UNROLL = 4;
constexpr int BLOCK = 256;

__device__ __forceinline__ uint4 round_tf32_vector(uint4 v) {
    return make_uint4(round_tf32_bits(v.x), round_tf32_bits(v.y), round_tf32_bits(v.z), round_tf32_bits(v.w));
}

extern "C" __global__ void __launch_bounds__(BLOCK)
round_tf32_copy(const unsigned* __restrict__ src, unsigned* __restrict__ dst, index_t words) {
    const uint4* src_vectors = reinterpret_cast<const uint4*>(src);
    uint4* dst_vectors = reinterpret_cast<uint4*>(dst);
    const index_t vectors = words / 4;
    const index_t step = (index_t)gridDim.x * BLOCK * UNROLL;
    for (index_t base = (index_t)blockIdx.x * BLOCK * UNROLL + threadIdx.x; base < vectors; base += step) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const index_t i = base + (index_t)u * BLOCK;
            if (i < vectors) v[u] = src_vectors[i];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const index_t i = base + (index_t)u * BLOCK;
            if (i < vectors) dst_vectors[i] = round_tf32_vector(v[u]);
        }
    }
    if (blockIdx.x == 0 && threadIdx.x < words % 4) {
        const index_t i = vectors * 4 + threadIdx.x;
        dst[i] = round_tf32_bits(src[i]);
    }
}
