// Hopper warpgroup MMA (wgmma, sm_90a): shared-memory matrix descriptors, the
// fences and commit/wait groups around the asynchronous MMAs, and the MMAs
// themselves for N = 8, 16, 32, 64, 128 and 256 with fp32 accumulators.
//
// Operands come from shared memory in one of two layouts, K-major by default.  The no-swizzle
// ("interleaved") layout: a core matrix is 8 rows (of M or N) of 16 bytes of K, stored as 128
// contiguous bytes (MN-major: 8 rows of K of 16 bytes of M or N); a descriptor names the first
// core matrix and two strides, between core matrices adjacent along K (leading byte offset) and
// along M or N (stride byte offset), so one tile can be read at any 16-byte aligned origin.  The
// 128-byte swizzle: rows of 128 bytes, see smem_descriptor_swizzle_128b.
// Needs MMA_* from mma.cuh.
#pragma once

// Descriptor bits: start address >> 4 in [0, 14), leading byte offset >> 4 in
// [16, 30), stride byte offset >> 4 in [32, 46), swizzle mode in [62, 64) (0: none).
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned address, unsigned leading_bytes,
                                                              unsigned stride_bytes) {
    return static_cast<unsigned long long>((address >> 4) & 0x3fffu)
           | static_cast<unsigned long long>((leading_bytes >> 4) & 0x3fffu) << 16
           | static_cast<unsigned long long>((stride_bytes >> 4) & 0x3fffu) << 32;
}

// The 128-byte swizzle (mode 1, bits [62, 64)): the operand is stored as rows of 128 bytes, each
// row's 16-byte chunks permuted by bits [7, 10) of its shared-memory address (swizzle_128b).  A
// K-major row holds 128 bytes of K for one M or N index (an MMA reads 32 bytes of it: start the
// descriptor 32 bytes in for the next); an MN-major row holds 64 16-bit values of M or N for one
// K index.  Either way a pixel's channel run in global memory lands as one row, so the copies that
// fill it coalesce: in the no-swizzle layout a pixel's 16-byte runs land in eight different core
// matrices, and each cp.async became an L2 request of its own.  The swizzle follows the address
// alone, so a descriptor may start at any row (a tap's moved origin in a halo) with a zero base
// offset, as measured on an H200.  The stride byte offset steps between groups of 8 rows; the
// leading byte offset between 128-byte-wide column blocks (MN-major operands wider than 64).
__device__ __forceinline__ unsigned long long smem_descriptor_swizzle_128b(unsigned address, unsigned column_bytes,
                                                                           unsigned row_group_bytes) {
    return smem_descriptor(address, column_bytes, row_group_bytes) | 1ull << 62;
}
// Where a 16-byte chunk at shared address `address` (a row's logical chunk) is stored in the 128-byte swizzle.
__device__ __forceinline__ unsigned swizzle_128b(unsigned address) { return address ^ ((address >> 3) & 0x70u); }

// Registers written by ordinary instructions (the zeroed accumulators) must be fenced
// before a wgmma reads them, and every MMA of a warpgroup issues after this fence.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory"); }

// Shared memory written through the generic proxy (stores, cp.async) becomes visible to
// the tensor cores' async proxy only after this fence, issued by each writing thread
// before the barrier that hands the data over.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keeps the compiler from moving reads or writes of accumulators across an MMA that is still in flight.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A's words in registers: fenced after the wait for the MMAs that read them, they stay live until
// then, so nothing else is given their registers while the tensor cores may still read them.
template <int N>
__device__ __forceinline__ void fence_registers(unsigned (&a)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// D[64 x N] (+)= A[64 x K] * B[K x N], K = 16 fp16/bf16 values or 8 TF32 values (32 bytes either way),
// A and B read through descriptors; accumulate = 0 overwrites D.  Each warp holds 16
// rows of D: thread lane has rows lane / 4 and lane / 4 + 8, columns 8 j + 2 (lane % 4)
// + {0, 1} in d[4 j + {0, 1}] and d[4 j + {2, 3}].
//
// TF32 operands are fp32 words whose low 13 mantissa bits the tensor cores ignore, so callers
// round them (cvt.rna) before they reach shared memory; they are K-major only.
//
// MN_MAJOR = 1 sets A's transpose bit and B_MN_MAJOR B's (16-bit types only; B's follows A's unless
// given): that operand is then stored MN-major, a core matrix being 8 rows of K of 16 bytes of M or N,
// 16 bytes apart; the stride byte offset steps along M or N and the leading byte offset along K.
template <int KIND, int N>
struct Wgmma;

template <int KIND, int N, int MN_MAJOR = 0, int B_MN_MAJOR = MN_MAJOR>
__device__ __forceinline__ void wgmma_async(float (&d)[N / 2], unsigned long long a, unsigned long long b,
                                            int accumulate) {
    Wgmma<KIND, N>::template mma<MN_MAJOR, B_MN_MAJOR>(d, a, b, accumulate);
}

// One wgmma.mma_async for each N, fp16, bf16 or TF32 inputs: N / 2 accumulator registers, then the
// two descriptors, the accumulate flag and the two transpose immediates (TF32 takes none).
// Only the register lists and operand numbers differ between the shapes; the macros below spell them once.
#define WGMMA_REGS_4 "%0, %1, %2, %3"
#define WGMMA_REGS_8 WGMMA_REGS_4 ", %4, %5, %6, %7"
#define WGMMA_REGS_16 WGMMA_REGS_8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_REGS_32 WGMMA_REGS_16 \
    ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_REGS_64 WGMMA_REGS_32 \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
    ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_REGS_128 WGMMA_REGS_64 \
    ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
    ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95" \
    ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
    ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WGMMA_OUTS_4 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define WGMMA_OUTS_8 WGMMA_OUTS_4, "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define WGMMA_OUTS_16 WGMMA_OUTS_8, \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WGMMA_OUTS_32 WGMMA_OUTS_16, \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_OUTS_64 WGMMA_OUTS_32, \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_OUTS_128 WGMMA_OUTS_64, \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
// REGS: the accumulators' operand list; A, B, P, T, TB: the operand numbers of the descriptors, the
// accumulate flag, MN_MAJOR and B_MN_MAJOR (the registers' count and the four after it); RA0-RA3, RB, RP: with A
// from registers, those of A's four words, B's descriptor and the accumulate flag.
#define WGMMA_INSTRUCTION(N, TYPE, REGS, A, B, P, T, TB)                                                \
    "{ .reg .pred p; setp.ne.b32 p, %" #P ", 0; wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." \
    TYPE " {" REGS "}, %" #A ", %" #B ", p, 1, 1, %" #T ", %" #TB "; }"
#define WGMMA_INSTRUCTION_TF32(N, REGS, A, B, P)                                                         \
    "{ .reg .pred p; setp.ne.b32 p, %" #P ", 0; wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 {" \
    REGS "}, %" #A ", %" #B ", p, 1, 1; }"
// TF32 with A from registers: four words a thread (wgmma's fragment layout: thread lane of warp w holds rows
// 16 w + lane / 4 (+ 8) and columns lane % 4 (+ 4) of the 64 x 8 block), B through its descriptor.
#define WGMMA_INSTRUCTION_TF32_RS(N, REGS, A0, A1, A2, A3, B, P)                                         \
    "{ .reg .pred p; setp.ne.b32 p, %" #P ", 0; wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 {" \
    REGS "}, {%" #A0 ", %" #A1 ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1; }"
#define WGMMA_SHAPE(N, REGS, OUTS, A, B, P, T, TB, RA0, RA1, RA2, RA3, RB, RP)                           \
    template <int KIND>                                                                               \
    struct Wgmma<KIND, N> {                                                                           \
        static_assert(KIND == MMA_F16 || KIND == MMA_BF16 || KIND == MMA_TF32,                        \
                      "wgmma here takes fp16, bf16 or TF32 inputs");                                  \
        template <int MN_MAJOR, int B_MN_MAJOR>                                                       \
        static __device__ __forceinline__ void mma(float (&d)[N / 2], unsigned long long a,           \
                                                   unsigned long long b, int accumulate) {            \
            if constexpr (KIND == MMA_F16)                                                            \
                asm volatile(WGMMA_INSTRUCTION(N, "f16", REGS, A, B, P, T, TB)                        \
                             : OUTS : "l"(a), "l"(b), "r"(accumulate), "n"(MN_MAJOR), "n"(B_MN_MAJOR)); \
            else if constexpr (KIND == MMA_BF16)                                                      \
                asm volatile(WGMMA_INSTRUCTION(N, "bf16", REGS, A, B, P, T, TB)                       \
                             : OUTS : "l"(a), "l"(b), "r"(accumulate), "n"(MN_MAJOR), "n"(B_MN_MAJOR)); \
            else {                                                                                    \
                static_assert(KIND != MMA_TF32 || (MN_MAJOR == 0 && B_MN_MAJOR == 0),                 \
                              "TF32 operands are K-major only");                                      \
                asm volatile(WGMMA_INSTRUCTION_TF32(N, REGS, A, B, P)                                 \
                             : OUTS : "l"(a), "l"(b), "r"(accumulate));                               \
            }                                                                                         \
        }                                                                                             \
        static __device__ __forceinline__ void mma_a_registers(float (&d)[N / 2], const unsigned (&a)[4], \
                                                               unsigned long long b, int accumulate) { \
            static_assert(KIND == MMA_TF32, "A from registers: TF32 only here");                     \
            asm volatile(WGMMA_INSTRUCTION_TF32_RS(N, REGS, RA0, RA1, RA2, RA3, RB, RP)               \
                         : OUTS : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate)); \
        }                                                                                             \
    };

WGMMA_SHAPE(8, WGMMA_REGS_4, WGMMA_OUTS_4, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 9)
WGMMA_SHAPE(16, WGMMA_REGS_8, WGMMA_OUTS_8, 8, 9, 10, 11, 12, 8, 9, 10, 11, 12, 13)
WGMMA_SHAPE(32, WGMMA_REGS_16, WGMMA_OUTS_16, 16, 17, 18, 19, 20, 16, 17, 18, 19, 20, 21)
WGMMA_SHAPE(64, WGMMA_REGS_32, WGMMA_OUTS_32, 32, 33, 34, 35, 36, 32, 33, 34, 35, 36, 37)
WGMMA_SHAPE(128, WGMMA_REGS_64, WGMMA_OUTS_64, 64, 65, 66, 67, 68, 64, 65, 66, 67, 68, 69)
WGMMA_SHAPE(256, WGMMA_REGS_128, WGMMA_OUTS_128, 128, 129, 130, 131, 132, 128, 129, 130, 131, 132, 133)

// D[64 x N] (+)= A[64 x 8] * B[8 x N] in TF32, A's rounded words in registers (Wgmma::mma_a_registers).
template <int N>
__device__ __forceinline__ void wgmma_async_a_registers(float (&d)[N / 2], const unsigned (&a)[4],
                                                        unsigned long long b, int accumulate) {
    Wgmma<MMA_TF32, N>::mma_a_registers(d, a, b, accumulate);
}
