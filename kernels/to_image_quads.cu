// Packs float32 activations for the TF32 grad_weight kernel: src[n][c][p] (NCHW) or src[n][p][c] (NHWC) goes to
// dst[n / 4][p][c][n % 4], each word rounded to TF32, the images past the batch zero.
//
// That kernel's K runs over (pixel, four images), a 16-byte slot holding one channel of four images at a pixel
// (TF32 wgmma takes K-major operands only).  Read in place, every slot is four words from four images, so each
// word was its own 4-byte copy.  Packed, a pixel's slots for a tile's channels are one contiguous run, copied in
// 16-byte pieces, already rounded, so the kernel needs no rounding pass over shared memory either.
//
// SPLIT_TF32 (strict float32's 3xTF32) writes each word's TF32 big part there and its TF32 residual
// (split_tf32_bits) in a second copy right after the first, [2][n / 4][p][c][n % 4].
//
// Both operands of a call are packed in one launch: blocks [0, x_blocks) pack x, the rest grad_output.  A block
// packs four images x 32 channels x 32 pixels through shared memory: the loads run along the source's contiguous
// axis (pixels or channels), the stores along channels, a warp's 32 slots one 512-byte run.
//
// VEC4 (NHWC, channels in whole float4s, 16-byte aligned sources) needs no transpose: a thread takes four channels
// of one pixel in 16-byte loads from each of the four images and stores their four slots, 64 contiguous bytes,
// so a warp reads 512-byte runs of each image and writes one 2 KB run.  The 32-channel tiles read 128 bytes of a
// pixel a block, scattered over the source; whole pixels read in order kept the pack nearer the copy bandwidth.
#include "tf32_round.cuh"

typedef {{INDEX_T}} index_t;

constexpr bool NHWC = {{NHWC}};
constexpr bool VEC4 = {{VEC4}};
constexpr bool SPLIT_TF32 = {{SPLIT_TF32}};
constexpr int TILE = 32, WARPS = 8, IMAGES = 4;
static_assert(NHWC || !VEC4, "the four-channel runs are an NHWC source's");

__device__ __forceinline__ unsigned word(float v) { return round_tf32_bits(__float_as_uint(v)); }

// One channel of four images at a pixel into its slot `at`: the rounded words, or (SPLIT_TF32) the big parts
// there and the residuals `part` slots on, in the second copy.
__device__ __forceinline__ void store_slot(uint4* __restrict__ dst, index_t at, index_t part,
                                           const float (&w)[IMAGES]) {
    if constexpr (SPLIT_TF32) {
        Tf32Parts t[IMAGES];
#pragma unroll
        for (int i = 0; i < IMAGES; ++i) t[i] = split_tf32_bits(__float_as_uint(w[i]));
        dst[at] = make_uint4(t[0].big, t[1].big, t[2].big, t[3].big);
        dst[part + at] = make_uint4(t[0].small, t[1].small, t[2].small, t[3].small);
    } else {
        dst[at] = make_uint4(word(w[0]), word(w[1]), word(w[2]), word(w[3]));
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
to_image_quads(const float* __restrict__ x, const float* __restrict__ grad_out, uint4* __restrict__ x_quads,
               uint4* __restrict__ grad_out_quads, index_t N, index_t C_x, index_t P_x, index_t C_go, index_t P_go,
               index_t x_blocks) {
    __shared__ float stage[VEC4 ? 1 : IMAGES][TILE][TILE + 1];   // [image][channel][pixel]; an odd pitch,
                                                                   // conflict-free both ways
    const bool is_x = static_cast<index_t>(blockIdx.x) < x_blocks;
    const float* src = is_x ? x : grad_out;
    uint4* dst = is_x ? x_quads : grad_out_quads;
    const index_t C = is_x ? C_x : C_go, P = is_x ? P_x : P_go;
    const index_t block = is_x ? blockIdx.x : blockIdx.x - x_blocks;
    if constexpr (VEC4) {
        const index_t runs = P * (C / 4);   // four-channel runs of one image
        const index_t quads = (N + IMAGES - 1) / IMAGES;
        const index_t item = block * (32 * WARPS) + threadIdx.x;   // (quad, pixel, run)
        if (item >= quads * runs) return;
        const index_t quad = item / runs, run = item % runs;
        float4 v[IMAGES];
#pragma unroll
        for (int i = 0; i < IMAGES; ++i) {
            const index_t n = quad * IMAGES + i;
            v[i] = n < N ? __ldg(reinterpret_cast<const float4*>(src + n * P * C) + run) : make_float4(0, 0, 0, 0);
        }
        const index_t at = item * 4, part = quads * P * C;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float w[IMAGES];
#pragma unroll
            for (int i = 0; i < IMAGES; ++i) w[i] = j == 0 ? v[i].x : j == 1 ? v[i].y : j == 2 ? v[i].z : v[i].w;
            store_slot(dst, at + j, part, w);
        }
        return;
    }
    const index_t tiles_p = (P + TILE - 1) / TILE, tiles_c = (C + TILE - 1) / TILE;
    const index_t p0 = block % tiles_p * TILE, c0 = block / tiles_p % tiles_c * TILE;
    const index_t quad = block / (tiles_p * tiles_c);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

#pragma unroll
    for (int r = warp; r < IMAGES * TILE; r += WARPS) {
        const int image = r / TILE, row = r % TILE;
        const index_t n = quad * IMAGES + image;
        if constexpr (NHWC) {
            const index_t p = p0 + row, c = c0 + lane;
            stage[image][lane][row] = n < N && p < P && c < C ? __ldg(src + (n * P + p) * C + c) : 0.0f;
        } else {
            const index_t c = c0 + row, p = p0 + lane;
            stage[image][row][lane] = n < N && c < C && p < P ? __ldg(src + (n * C + c) * P + p) : 0.0f;
        }
    }
    __syncthreads();
    const index_t c = c0 + lane;
    const index_t part = (N + IMAGES - 1) / IMAGES * P * C;   // slots of one packed copy
#pragma unroll
    for (int row = warp; row < TILE; row += WARPS) {
        const index_t p = p0 + row;
        if (p >= P || c >= C) continue;
        float w[IMAGES];
#pragma unroll
        for (int i = 0; i < IMAGES; ++i) w[i] = stage[i][lane][row];
        store_slot(dst, (quad * P + p) * C + c, part, w);
    }
}
