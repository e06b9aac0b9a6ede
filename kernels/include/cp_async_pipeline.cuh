// Asynchronous global -> shared copies (sm_80+) and the ring of STAGES shared
// buffers they fill: while the math works on one tile, the copies of the next
// STAGES - 1 tiles are in flight, and no registers stage the data.
#pragma once

// A copy whose source is masked off reads nothing and fills its 16 bytes with
// zeros, so tile edges need no separate stores.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
// The same copy through L1 (.ca): gathered activation tiles overlap from tap to tap
// (neighbouring taps read the same pixels shifted by one), so L1 hits spare L2.
__device__ __forceinline__ void cp_async_16_l1(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
// One 4-byte word through L1, zero-filled where masked off: for tiles whose shared rows run across global
// memory's contiguous dimension (a [pixel][channel] tile of an NCHW image), where no 16-byte run lines up.
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0));
}
template <bool L1>
__device__ __forceinline__ void cp_async_16_via(unsigned dst, const void* src, bool ok) {
    if constexpr (L1) cp_async_16_l1(dst, src, ok); else cp_async_16(dst, src, ok);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING)); }

// For kt = 0 .. k_tiles - 1: issue(kt, s) starts the copies of tile kt into buffer s
// (one commit group per tile), and consume(s) runs once tile kt has landed in buffer
// s = kt % STAGES for every thread of the block.  The whole block must call it.
template <int STAGES, typename Issue, typename Consume>
__device__ __forceinline__ void cp_async_pipeline(int k_tiles, Issue&& issue, Consume&& consume) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) issue(s, s);
        cp_async_commit();  // empty groups keep the wait count uniform
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        // Tile kt has landed for every thread, and every warp is done with the
        // buffer the next issue overwrites (it held tile kt - 1).
        __syncthreads();
        const int next = kt + STAGES - 1;
        if (next < k_tiles) issue(next, next % STAGES);
        cp_async_commit();
        consume(kt % STAGES);
    }
    cp_async_wait<0>();
}
