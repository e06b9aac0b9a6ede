// mbarriers (sm_90) and the asynchronous copies that complete on them: a producer's
// copies signal a "full" barrier, consumers wait on it, and consumers signal an "empty"
// barrier the producer waits on before it refills the buffer.
//
// Shared-memory operands are 32-bit shared-window addresses (smem_addr in mma.cuh).
#pragma once

__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised barriers visible to the copy engine (before the block-wide barrier).
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// One arrival that also expects `bytes` more to land on the barrier's current phase.
__device__ __forceinline__ void mbarrier_expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits until the phase with this parity has completed.  A fresh barrier counts the phase
// before its first (parity 1) as complete, so a producer's first wait on an "empty"
// barrier passes at once.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{ .reg .pred done;\n"
        "wait_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=; }" ::"r"(bar), "r"(parity) : "memory");
}

// The calling thread's earlier cp.async copies arrive on `bar` when they have landed; the
// arrival is one of the barrier's expected count.
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared
// memory with the copy engine, completing `bytes` on `bar`.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// Moves registers from the warpgroups that need few (a producer) to those that need many.
template <int REGISTERS>
__device__ __forceinline__ void registers_release() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGISTERS)); }
template <int REGISTERS>
__device__ __forceinline__ void registers_claim() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGISTERS)); }

// A TMA descriptor (CUtensorMap) as a kernel parameter: 128 opaque bytes, which the host encodes
// (cupyconv.plans.tensor_map) and the kernel takes as `const __grid_constant__ TensorMap`, so that its
// address is one the copy engine may read.
struct alignas(64) TensorMap {
    unsigned long long words[16];
};

// The copy engine copies a box of a 4-D tensor at element coordinates (c0 innermost .. c3) into
// shared memory as the descriptor lays it out (its swizzle included), completing the box's bytes on
// `bar`.  Coordinates may lie outside the tensor: such elements land as zeros and count as bytes.
__device__ __forceinline__ void tensor_copy_4d(unsigned dst, const TensorMap& map, int c0, int c1, int c2, int c3,
                                               unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}
