// A persistent GEMM block on Hopper's warpgroup MMA (wgmma, sm_90a) for the one-tap layers' GEMMs (the scatter
// GEMM's forward, the gather GEMM's grad_input): the block walks tiles of BM = 64 MB rows x BN columns, the N
// tiles of one row tile adjacent (so its A rows come from L2), in steps of CK elements of K.
//
// The last warpgroup produces: for each step of a tile it copies the step's A rows and B (with cp.async, or
// the copy engine) into a ring of STAGES buffers as 128-byte swizzled rows, landing on the step's "full"
// barrier.  Two consumer warpgroups
// take the tiles in turn (ping-pong), each a whole BM x BN tile in its accumulators: while one stores its tile
// straight from the registers, the other's MMAs run, and with few K steps a tile the stores are a large share
// of the time.
//
// What a step holds and where a tile goes are the kernel's, as two objects:
//   producer.tile(m0, n0)     once per tile, before its steps, by every producer thread;
//   producer.step(a, b, c, full)
//                             the calling producer thread's copies of step c: BM rows of 128 bytes of A at
//                             shared address a, B at b (K-major: BN rows of 128 bytes of K; MN-major: BN / 64
//                             blocks of CK rows of 64 columns, 16-bit types only), landing on barrier `full`:
//                             with Producer::CP_ASYNC each thread's cp.asyncs arrive on it after the call, and
//                             Producer::FULL_ARRIVALS counts those 128 arrivals and any the producer makes itself
//                             (the copy engine's expected bytes);
//   store(acc, m0, n0)        a consumer thread's accumulators into the destination (wgmma's fragment layout:
//                             thread lane of warp w holds rows 16 w + lane / 4 (+ 8) of each 64-row block),
//                             walked with store_pairs.
// Needs layer.cuh, mma.cuh, wgmma.cuh and mbarrier_copy.cuh.
#pragma once

// What a producer whose copies are all the copy engine's declares: its first thread issues them, and a step's
// full barrier waits for their bytes alone.
struct CopyEngineProducer {
    static constexpr bool CP_ASYNC = false;
    static constexpr int FULL_ARRIVALS = 1;   // the boxes' bytes
};

// A step's A for a TF32 MMA from registers: rows r and r + 8 of the swizzled 128-byte rows at shared address
// `rows`, words lane % 4 (+ 4) of each 8-word MMA step of K, rounded to TF32 as the rounding copies round them
// (the tensor cores would truncate them).  Rows r of warp w's lanes are 16 w + lane / 4: for each MMA step the
// warp's eight rows take one 16-byte chunk each, eight different chunk slots under the swizzle, so the loads hit
// every bank once.
template <int MMA_STEPS>
__device__ __forceinline__ void load_a_rounded(unsigned rows, int r, int lane, unsigned (&a)[MMA_STEPS][4]) {
#pragma unroll
    for (int kk = 0; kk < MMA_STEPS; ++kk)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // word lane % 4 of chunk 2 kk + half of row r + 8 h
                const unsigned at = swizzle_128b(rows + (r + 8 * h) * 128 + (2 * kk + half) * 16) + (lane % 4) * 4;
                unsigned v;
                asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(at));
                a[kk][2 * half + h] = round_tf32_bits(v);
            }
}

// PRODUCER_REGISTERS: what the producer keeps (setmaxnreg); the consumers share what it frees.  A_REGISTERS
// (TF32): the consumers take A from shared memory into registers, rounding it on the way, so the producer may
// land unrounded float32 words.
template <int KIND, int MB, int BN, int STAGES, int K_STEPS, int N_TILES, bool B_MN_MAJOR, int PRODUCER_REGISTERS = 56,
          bool A_REGISTERS = false>
struct PingPongGemm {
    static constexpr int CONSUMERS = 2;
    static constexpr int THREADS = 128 * (CONSUMERS + 1);
    static constexpr int BM = 64 * MB;
    static constexpr int CK = 128 / sizeof(scalar_t);     // elements of K a step: one 128-byte row
    static constexpr int K_STEP = 32 / sizeof(scalar_t);  // elements of K one wgmma consumes
    static constexpr int A_BYTES = BM * 128;
    static constexpr int B_COLUMN_BLOCK = CK * 128;       // MN-major B: CK rows of 64 16-bit columns
    static constexpr int B_BYTES = BN * 128;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    // A block starts with the registers its launch bounds give each thread (65536 / THREADS, in eights); the
    // consumers' setmaxnreg.inc waits until the producer's .dec has freed what they claim, so they may claim no
    // more than it frees, or the block hangs.
    static constexpr int LAUNCH_REGISTERS = 65536 / THREADS / 8 * 8;
    static constexpr int CONSUMER_REGISTERS =
        (LAUNCH_REGISTERS * (CONSUMERS + 1) - PRODUCER_REGISTERS) / CONSUMERS / 8 * 8;

    static_assert(BN % 64 == 0 && BN <= 256 && MB >= 1 && MB * BN <= 256,
                  "whole 64-column blocks; a consumer's accumulators fit its registers");
    static_assert(!B_MN_MAJOR || sizeof(scalar_t) == 2, "an MN-major B is 16-bit only");
    static_assert(!A_REGISTERS || KIND == MMA_TF32, "A from registers: TF32 only");
    static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses reach 256 KB");
    static_assert(PRODUCER_REGISTERS % 8 == 0 && PRODUCER_REGISTERS >= 24 && CONSUMER_REGISTERS <= 256,
                  "setmaxnreg's range");

    // A consumer thread's accumulators as pairs of neighbouring columns, in wgmma's fragment layout: row(r) is
    // asked once for each of the thread's rows r of the tile and says where that row goes (its `keep` false for
    // a row no store keeps); put(at, n, v0, v1) then stores columns n and n + 1 of the tile's row there.
    template <class Row, class Put>
    static __device__ __forceinline__ void store_pairs(const float (&acc)[MB][BN / 2], Row row, Put put) {
        const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const auto at = row(mb * 64 + warp * 16 + lane / 4 + h * 8);
                if (!at.keep) continue;
#pragma unroll
                for (int jn = 0; jn < BN / 8; ++jn)
                    put(at, jn * 8 + (lane % 4) * 2, acc[mb][jn * 4 + h * 2], acc[mb][jn * 4 + h * 2 + 1]);
            }
        }
    }

    // The consumers' main loop with A from registers.  A's words may change only once the MMAs reading them are
    // done.  Where two sets of them fit beside the accumulators, each step's A sits in one of two register sets:
    // a step's MMAs stay in flight while the next step loads the other set, and a buffer is released once its
    // step's MMAs are done.  Otherwise (128 x 128 tiles: ptxas serialises the MMAs of two sets) each step waits
    // for its own MMAs, while the other consumer's may keep the tensor cores busy.  Every thread of the
    // warpgroup reads A, so each releases the buffer on its own (an arrival orders only its own thread's reads
    // before the producer's refill): an "empty" barrier expects 128 arrivals here.
    enum : int { A_SETS = MB * BN / 2 + 2 * MB * 16 <= 160 ? 2 : 1 };   // an enum: no global for ptxas
    typedef unsigned ARegisters[A_SETS][MB][CK / K_STEP][4];

    template <int SET, class Slot>
    static __device__ __forceinline__ void a_registers_step(float (&acc)[MB][BN / 2], ARegisters& frag, int s, int c,
                                                            int warpgroup, int& pending, Slot a_slot,
                                                            unsigned long long* full, unsigned long long* empty,
                                                            unsigned long long* turn) {
        const int lane = threadIdx.x % 32, r = threadIdx.x % 128 / 32 * 16 + lane / 4;
        mbarrier_wait(smem_addr(&full[s % STAGES]), (s / STAGES) & 1);
        if (threadIdx.x % 128 == 0 && c == K_STEPS - 1) mbarrier_arrive(smem_addr(&turn[1 - warpgroup]));
        fence_async_shared();   // cp.async copies came through the generic proxy; wgmma reads B async
        const unsigned a = a_slot(s), b = a + A_BYTES;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) load_a_rounded(a + mb * 64 * 128, r, lane, frag[SET][mb]);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < CK / K_STEP; ++kk) {
            const unsigned long long b_desc = smem_descriptor_swizzle_128b(b + kk * 32, 16, 1024);
#pragma unroll
            for (int mb = 0; mb < MB; ++mb) wgmma_async_a_registers<BN>(acc[mb], frag[SET][mb][kk], b_desc, 1);
        }
        wgmma_commit();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
        if constexpr (A_SETS == 2) {
            wgmma_wait<1>();   // the previous step's MMAs are done: its registers and buffer are free
#pragma unroll
            for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                for (int kk = 0; kk < CK / K_STEP; ++kk) fence_registers(frag[A_SETS - 1 - SET][mb][kk]);
            if (pending >= 0) mbarrier_arrive(smem_addr(&empty[pending]));
            pending = s % STAGES;
        } else {
            wgmma_wait<0>();
#pragma unroll
            for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                for (int kk = 0; kk < CK / K_STEP; ++kk) fence_registers(frag[0][mb][kk]);
            mbarrier_arrive(smem_addr(&empty[s % STAGES]));
        }
    }

    template <class Producer, class Store>
    static __device__ __forceinline__ void run(unsigned char* smem, index_t tile_count, Producer& producer,
                                               Store& store) {
        __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
        // turn[w]: the other consumer has waited on its previous tile's last step (below).
        __shared__ __align__(8) unsigned long long turn[CONSUMERS];

        const int tid = threadIdx.x;
        if (tid == 0) {
            for (int s = 0; s < STAGES; ++s) {
                mbarrier_init(smem_addr(&full[s]), Producer::FULL_ARRIVALS);
                // the consuming warpgroup: one arrival, or with A from registers one a thread
                mbarrier_init(smem_addr(&empty[s]), A_REGISTERS ? 128 : 1);
            }
            for (int w = 0; w < CONSUMERS; ++w) mbarrier_init(smem_addr(&turn[w]), 1);
            fence_mbarrier_init();
        }
        __syncthreads();
        const unsigned smem_base = smem_addr(smem);
        auto a_slot = [&](int s) { return smem_base + (s % STAGES) * STAGE_BYTES; };
        const int warpgroup = tid / 128;

        if (warpgroup == CONSUMERS) {
            // -------------------------------------------------------------- producer
            registers_release<PRODUCER_REGISTERS>();
            int s_iter = 0;
            for (index_t tile = blockIdx.x; tile < tile_count; tile += gridDim.x) {
                producer.tile(tile / N_TILES * BM, static_cast<int>(tile % N_TILES) * BN);
                for (int c = 0; c < K_STEPS; ++c, ++s_iter) {
                    mbarrier_wait(smem_addr(&empty[s_iter % STAGES]), ((s_iter / STAGES) & 1) ^ 1);
                    const unsigned a = a_slot(s_iter), bar = smem_addr(&full[s_iter % STAGES]);
                    producer.step(a, a + A_BYTES, c, bar);
                    if constexpr (Producer::CP_ASYNC) cp_async_arrive(bar);
                }
            }
            if constexpr (Producer::CP_ASYNC) cp_async_wait<0>();
            return;
        }

        // ------------------------------------------------------------------ consumers
        registers_claim<CONSUMER_REGISTERS>();
        const bool signals = tid % 128 == 0;   // one arrival per warpgroup on the "turn" (and most "empty") barriers
        float acc[MB][BN / 2];
        // This warpgroup's tiles are every other one of the block's, and their steps every other run of K_STEPS.
        // A full barrier's parity tells its phases apart only while its waiter is at most one phase behind, so a
        // warpgroup starts a tile only once the other has waited on the previous tile's last step: the producer
        // has then filled every step up to there, and this tile's first step is at most one ring ahead of it.
        int s_iter = warpgroup * K_STEPS, turns = 0;
        for (index_t tile = blockIdx.x + warpgroup * gridDim.x; tile < tile_count;
             tile += CONSUMERS * gridDim.x, s_iter += CONSUMERS * K_STEPS, ++turns) {
            if (warpgroup == 1 || turns > 0) {
                const int waited = warpgroup == 1 ? turns : turns - 1;   // the other's tiles this one follows
                mbarrier_wait(smem_addr(&turn[warpgroup]), waited & 1);
            }
#pragma unroll
            for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) acc[mb][i] = 0.f;
            if constexpr (A_REGISTERS) {
                ARegisters frag;
                if constexpr (A_SETS == 2) {   // the first step fences the second set as its predecessor's
#pragma unroll
                    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
                        for (int kk = 0; kk < CK / K_STEP; ++kk)
#pragma unroll
                            for (int i = 0; i < 4; ++i) frag[1][mb][kk][i] = 0u;
                }
                int pending = -1;   // the step whose MMAs may still run
                // Steps alternate register sets, two a turn of the loop so that each set's index is a constant.
                for (int c = 0; c < K_STEPS; c += A_SETS) {
                    a_registers_step<0>(acc, frag, s_iter + c, c, warpgroup, pending, a_slot, full, empty, turn);
                    if (A_SETS == 2 && c + 1 < K_STEPS)
                        a_registers_step<A_SETS - 1>(acc, frag, s_iter + c + 1, c + 1, warpgroup, pending, a_slot, full,
                                                     empty, turn);
                }
                wgmma_wait<0>();
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) {
                    fence_registers(acc[mb]);
#pragma unroll
                    for (int kk = 0; kk < CK / K_STEP; ++kk) {
#pragma unroll
                        for (int set = 0; set < A_SETS; ++set) fence_registers(frag[set][mb][kk]);
                    }
                }
                if (pending >= 0) mbarrier_arrive(smem_addr(&empty[pending]));
            } else {
                int pending = -1;   // the step whose MMAs may still run
                for (int c = 0; c < K_STEPS; ++c) {
                    const int s = s_iter + c;
                    mbarrier_wait(smem_addr(&full[s % STAGES]), (s / STAGES) & 1);
                    if (signals && c == K_STEPS - 1) mbarrier_arrive(smem_addr(&turn[1 - warpgroup]));
                    fence_async_shared();   // cp.async copies came through the generic proxy; wgmma reads async
                    const unsigned a = a_slot(s), b = a + A_BYTES;
#pragma unroll
                    for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < CK / K_STEP; ++kk) {
                        // A: 32 bytes into its rows.  B: the same into its rows (K-major), or K_STEP rows of the
                        // MN-major column blocks.
                        const unsigned long long b_desc =
                            B_MN_MAJOR ? smem_descriptor_swizzle_128b(b + kk * K_STEP * 128, B_COLUMN_BLOCK, 1024)
                                       : smem_descriptor_swizzle_128b(b + kk * 32, 16, 1024);
#pragma unroll
                        for (int mb = 0; mb < MB; ++mb)
                            wgmma_async<KIND, BN, 0, B_MN_MAJOR ? 1 : 0>(
                                acc[mb], smem_descriptor_swizzle_128b(a + mb * 64 * 128 + kk * 32, 16, 1024), b_desc, 1);
                    }
                    wgmma_commit();
#pragma unroll
                    for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
                    wgmma_wait<1>();   // the previous step's MMAs are done: release its buffer
                    if (signals && pending >= 0) mbarrier_arrive(smem_addr(&empty[pending]));
                    pending = s % STAGES;
                }
                wgmma_wait<0>();
#pragma unroll
                for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
                if (signals && pending >= 0) mbarrier_arrive(smem_addr(&empty[pending]));
            }
            store(acc, tile / N_TILES * BM, static_cast<int>(tile % N_TILES) * BN);
        }
    }
};
