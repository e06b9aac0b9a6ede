// Tensor-core building blocks shared by the implicit-GEMM kernels (sm_80 and newer).
//
// Operand tiles live in shared memory as [rows][K] with K contiguous, 64 bytes of K
// per stage (32 fp16/bf16 values or 16 fp32 values) and a 16-byte pad per row.  The
// 80-byte row pitch puts the eight 16-byte rows that one ldmatrix phase reads on
// disjoint banks, and the same byte addressing serves every element type: an fp32
// word read by ldmatrix as two b16 halves lands exactly where the m16n8k8 TF32
// fragment wants it, so fp16, bf16 and TF32 share one fragment loader.
#pragma once
#include "tf32_round.cuh"

#define MMA_F16 0
#define MMA_BF16 1
#define MMA_TF32 2
#define MMA_3XTF32 3  // fp32 split into big + small TF32 parts: fp32-level accuracy

constexpr int TILE_K_WORDS = 16;              // 64 bytes of K per stage
constexpr int ROW_WORDS = TILE_K_WORDS + 4;   // 80-byte pitch: conflict-free ldmatrix
constexpr int KSTEP_WORDS = 8;                // one mma consumes 32 bytes of K

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ unsigned to_tf32(unsigned bits) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(bits)));
    return r;
}

// Rounds the four fp32 words at a 16-byte aligned shared-memory address to TF32 in place: for
// wgmma, whose tensor cores read TF32 operands from shared memory and drop the low bits unrounded.
__device__ __forceinline__ void round_shared_tf32(unsigned address) {
    unsigned v0, v1, v2, v3;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3) : "r"(address));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 ::"r"(address), "r"(to_tf32(v0)), "r"(to_tf32(v1)), "r"(to_tf32(v2)), "r"(to_tf32(v3)) : "memory");
}

// Splits the four fp32 words at a 16-byte aligned shared-memory address into TF32 parts (split_tf32_bits): the
// big parts in place, the small ones at `small_address`, for the 3xTF32 wgmma kernels.
__device__ __forceinline__ void split_shared_tf32(unsigned address, unsigned small_address) {
    unsigned v[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(address));
    Tf32Parts p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = split_tf32_bits(v[i]);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 ::"r"(address), "r"(p[0].big), "r"(p[1].big), "r"(p[2].big), "r"(p[3].big) : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};"
                 ::"r"(small_address), "r"(p[0].small), "r"(p[1].small), "r"(p[2].small), "r"(p[3].small) : "memory");
}

__device__ __forceinline__ unsigned finite_or_zero(unsigned bits) {
    return (bits & 0x7f800000u) == 0x7f800000u ? 0u : bits;
}

// The part of an fp32 value that its TF32 rounding dropped, itself rounded to TF32.
// Inf and NaN have no finite remainder (inf - inf is NaN): their big part alone
// carries them, so an Inf input stays Inf as in torch.
__device__ __forceinline__ unsigned tf32_residual(unsigned bits, unsigned big) {
    return to_tf32(finite_or_zero(__float_as_uint(__uint_as_float(bits) - __uint_as_float(big))));
}

template <int KIND>
__device__ __forceinline__ void mma_16x8(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

template <>
__device__ __forceinline__ void mma_16x8<MMA_F16>(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16x8<MMA_BF16>(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16x8<MMA_TF32>(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The m16n8k8 shape in 16 bits: a K step of 8 channels, for layers of 8 channels a group.
template <int KIND>
__device__ __forceinline__ void mma_16x8x8(float (&c)[4], const unsigned (&a)[2], unsigned b) {
    static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "16-bit operands");
    if constexpr (KIND == MMA_F16)
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b));
    else
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// One warp's share of a block tile: MI x NI mma tiles of 16 x 8 fed from [rows][K]
// shared-memory tiles, for the 64 bytes of K of one stage.  With B_K_PITCH (words, 16-bit
// kinds only) the B tile is [K][N] instead, B_K_PITCH words from one k row to the next, and
// its fragments come through ldmatrix.trans (a channels_last weight's output channels run along N).
// A_PITCH and B_PITCH (words, 4 mod 8 so that one ldmatrix phase's rows fall on disjoint banks) and KSTEPS
// (32 bytes of K each) shape tiles other than the GEMM loop's 80-byte rows, for every kind.
template <int KIND, int MI, int NI, int B_K_PITCH = 0, int A_PITCH = ROW_WORDS, int B_PITCH = ROW_WORDS,
          int KSTEPS = TILE_K_WORDS / KSTEP_WORDS>
__device__ __forceinline__ void warp_tile_mma(float (&acc)[MI][NI][4], const unsigned* a_tile,
                                              const unsigned* b_tile, int warp_row, int warp_col, int lane) {
    static_assert(NI % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    static_assert(B_K_PITCH == 0 || KIND == MMA_F16 || KIND == MMA_BF16, "[K][N] B tiles hold 16-bit operands");
    static_assert(A_PITCH % 8 == 4 && B_PITCH % 8 == 4, "conflict-free ldmatrix rows");
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned a[MI][4], b[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            const int row = warp_row + mi * 16 + (lane & 15);
            ldmatrix_x4(a[mi], smem_addr(a_tile + row * A_PITCH + ks * KSTEP_WORDS + (lane >> 4) * 4));
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni += 2) {
            // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
            unsigned r[4];
            if constexpr (B_K_PITCH > 0) {
                const int k = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, n = warp_col + ni * 8 + (lane >> 4) * 8;
                ldmatrix_x4_trans(r, smem_addr(b_tile + k * B_K_PITCH + n / 2));
            } else {
                const int row = warp_col + ni * 8 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(r, smem_addr(b_tile + row * B_PITCH + ks * KSTEP_WORDS + ((lane >> 3) & 1) * 4));
            }
            b[ni][0] = r[0]; b[ni][1] = r[1]; b[ni + 1][0] = r[2]; b[ni + 1][1] = r[3];
        }
        if constexpr (KIND == MMA_F16 || KIND == MMA_BF16) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) mma_16x8<KIND>(acc[mi][ni], a[mi], b[ni]);
        } else {
            unsigned a_big[MI][4], b_big[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int q = 0; q < 4; ++q) a_big[mi][q] = to_tf32(a[mi][q]);
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int q = 0; q < 2; ++q) b_big[ni][q] = to_tf32(b[ni][q]);
            if constexpr (KIND == MMA_3XTF32) {
                // Small cross terms first, so they are not lost against the big product.
                unsigned a_small[MI][4], b_small[NI][2];
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int q = 0; q < 4; ++q) a_small[mi][q] = tf32_residual(a[mi][q], a_big[mi][q]);
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                    for (int q = 0; q < 2; ++q) b_small[ni][q] = tf32_residual(b[ni][q], b_big[ni][q]);
                // An infinite big part times the other operand's residual would add a
                // second Inf whose sign is the residual's: NaN.  The big x big product
                // alone carries non-finite values, so the cross terms drop them.
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    unsigned a_cross[4];
#pragma unroll
                    for (int q = 0; q < 4; ++q) a_cross[q] = finite_or_zero(a_big[mi][q]);
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni) {
                        const unsigned b_cross[2] = {finite_or_zero(b_big[ni][0]), finite_or_zero(b_big[ni][1])};
                        mma_16x8<MMA_TF32>(acc[mi][ni], a_small[mi], b_cross);
                        mma_16x8<MMA_TF32>(acc[mi][ni], a_cross, b_small[ni]);
                    }
                }
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) mma_16x8<MMA_TF32>(acc[mi][ni], a_big[mi], b_big[ni]);
        }
    }
}

// The same warp tile product for 16-bit operands stored K-major: [K][rows] tiles of
// 16-bit elements with rows contiguous (channels_last activations land that way).
// ldmatrix.trans turns each 8x8 block into the row-major (A) or column-major (B)
// fragment the mma wants.  Pitches are in 32-bit words and should be 4 (mod 32)
// so the eight rows of one ldmatrix phase fall on disjoint banks.
template <int KIND, int MI, int NI, int A_PITCH, int B_PITCH, int KSTEPS>
__device__ __forceinline__ void warp_tile_mma_kmajor(float (&acc)[MI][NI][4], const unsigned* a_tile,
                                                     const unsigned* b_tile, int warp_row, int warp_col,
                                                     int lane) {
    static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "K-major tiles hold 16-bit operands");
    static_assert(NI % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    const int r = lane & 7, j = lane >> 3;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        unsigned a[MI][4], b[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
            // matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
            const int k = ks * 16 + r + (j >> 1) * 8, m = warp_row + mi * 16 + (j & 1) * 8;
            ldmatrix_x4_trans(a[mi], smem_addr(a_tile + k * A_PITCH + m / 2));
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni += 2) {
            // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
            const int k = ks * 16 + r + (j & 1) * 8, n = warp_col + ni * 8 + (j >> 1) * 8;
            unsigned q[4];
            ldmatrix_x4_trans(q, smem_addr(b_tile + k * B_PITCH + n / 2));
            b[ni][0] = q[0]; b[ni][1] = q[1]; b[ni + 1][0] = q[2]; b[ni + 1][1] = q[3];
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) mma_16x8<KIND>(acc[mi][ni], a[mi], b[ni]);
    }
}

// Which (row, word) of a ROWS x TILE_K_WORDS shared tile a thread's q-th loaded word
// is, and how the words are stored.  Rows
// fastest gives each thread one row and a run of adjacent words (stored as 16-byte
// vectors); K fastest gives each thread one word column across several rows.
template <int ROWS, bool ROWS_FASTEST, int THREADS>
struct TileMap {
    static constexpr int WORDS = ROWS * TILE_K_WORDS / THREADS;
    __device__ static int row(int tid, int q) {
        return ROWS_FASTEST ? tid % ROWS : tid / TILE_K_WORDS + q * (THREADS / TILE_K_WORDS);
    }
    __device__ static int word(int tid, int q) { return ROWS_FASTEST ? (tid / ROWS) * WORDS + q : tid % TILE_K_WORDS; }
    __device__ static void store(unsigned* tile, int tid, const unsigned (&v)[WORDS]) {
        if constexpr (ROWS_FASTEST && WORDS % 4 == 0) {
#pragma unroll
            for (int q = 0; q < WORDS; q += 4)
                *reinterpret_cast<uint4*>(tile + row(tid, q) * ROW_WORDS + word(tid, q)) =
                    make_uint4(v[q], v[q + 1], v[q + 2], v[q + 3]);
        } else {
#pragma unroll
            for (int q = 0; q < WORDS; ++q) tile[row(tid, q) * ROW_WORDS + word(tid, q)] = v[q];
        }
    }
};
template <int MI, int NI>
__device__ __forceinline__ void zero(float (&acc)[MI][NI][4]) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.f;
}

// Tensor-core fp32 accumulation does not round to nearest, and its error grows with
// the length of the sum.  Strict float32 therefore moves the mma accumulators into an
// ordinary fp32 total after every stage; the other kinds keep cuDNN's behaviour.
template <int MI, int NI>
__device__ __forceinline__ void promote(float (&total)[MI][NI][4], float (&acc)[MI][NI][4]) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                total[mi][ni][c] += acc[mi][ni][c];
                acc[mi][ni][c] = 0.f;
            }
}

template <int KIND, typename Acc>
__device__ __forceinline__ const Acc& pick_result(const Acc& acc, const Acc& total) {
    return KIND == MMA_3XTF32 ? total : acc;
}

// Raw storage bits of one element, zero when masked off; 16-bit types are packed in
// pairs (lower K index in the low half), fp32 is one value per word.
template <typename T>
__device__ __forceinline__ unsigned raw_bits(const T* p, bool ok) {
    if constexpr (sizeof(T) == 2) {
        return ok ? static_cast<unsigned>(__ldg(reinterpret_cast<const unsigned short*>(p))) : 0u;
    } else {
        return ok ? __ldg(reinterpret_cast<const unsigned*>(p)) : 0u;
    }
}
