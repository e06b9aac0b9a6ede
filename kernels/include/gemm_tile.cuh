// The block tile of a tensor-core implicit GEMM: BM x BN outputs shared among
// WARPS_M x WARPS_N warps, each warp MI x NI mma tiles of 16 x 8, and K consumed
// BK elements (TILE_K_WORDS words, 64 bytes) a stage.  Include after layer.cuh and mma.cuh.
#pragma once

constexpr int KIND = {{MMA_KIND}};
constexpr int BM = {{BM}}, BN = {{BN}};
constexpr int WARPS_M = {{WARPS_M}}, WARPS_N = {{WARPS_N}};

constexpr int THREADS = WARPS_M * WARPS_N * 32;
// At least 8 resident warps per SM, so one block's barrier does not idle the SM; a
// 64x64 warp tile (128 accumulators a thread) needs the whole register file for one block.
constexpr int MIN_BLOCKS = BM * BN / THREADS >= 128 ? 1 : THREADS >= 256 ? 2 : THREADS >= 128 ? 3 : 4;
constexpr int PER_WORD = 4 / sizeof(scalar_t);
constexpr int BK = TILE_K_WORDS * PER_WORD;
constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
constexpr int MI = WM / 16, NI = WN / 8;

static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tiles are whole 16x16 mma pairs");
static_assert(THREADS % BM == 0 && THREADS % BN == 0 && THREADS % TILE_K_WORDS == 0, "loader mapping");
