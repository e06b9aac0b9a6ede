// Thread-block clusters (sm_90): bulk copies that one CTA issues and the copy engine
// delivers to the same shared-memory offset of every CTA in the cluster (multicast),
// the mbarriers those copies complete on, and the cluster-wide barrier.
//
// Shared-memory operands are 32-bit shared-window addresses (smem_addr in mma.cuh); the
// executing CTA's addresses are valid cluster addresses for itself.
#pragma once

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// The two halves of a cluster barrier: memory operations before arrive (release) are
// visible to every thread of the cluster after its matching wait (acquire).  Every
// thread of every CTA alternates them, so a CTA may do other work in between.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised mbarriers visible to the other CTAs' copies (before the cluster barrier).
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also expects `bytes` more to land on this barrier's current phase.
// The bytes may land before the expectation is set: the phase cannot complete while its
// arrival is still pending.
__device__ __forceinline__ void mbarrier_expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits until the phase with this parity has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{ .reg .pred done;\n"
        "wait_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=; }" ::"r"(bar), "r"(parity) : "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to
// offset `dst` of every CTA in `cta_mask`, completing `bytes` on each one's barrier `bar`.
__device__ __forceinline__ void bulk_copy_multicast(unsigned dst, const void* src, unsigned bytes, unsigned bar,
                                                    unsigned short cta_mask) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
                 "[%0], [%1], %2, [%3], %4;" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(cta_mask) : "memory");
}
