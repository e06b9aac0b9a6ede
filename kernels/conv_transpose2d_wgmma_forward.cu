// Forward of a transposed convolution on Hopper's warpgroup MMA (wgmma, sm_90a), one
// stride phase per grid z, with every input pixel brought into shared memory once per
// block and read there by all the taps.
//
// Output rows oh = SH*i + rh of phase (rh, rw) read input rows i + dh for the taps whose
// (rh + PH - kh*DH) is a multiple of SH, dh being that quotient; columns likewise.  A
// block computes a TILE_H x TILE_W patch of one image's phase grid for BN output
// channels.  For each chunk of CK input channels it copies the input "halo" the patch
// needs, (TILE_H + span of dh) x (TILE_W + span of dw) pixels, into shared memory as
// [16-byte channel group][halo row][halo column].  Eight neighbouring pixels of a halo
// row are then one core matrix of the A operand, a halo row apart from the next eight,
// so tap (dh, dw) is the same buffer read from an origin moved by (dh, dw) pixels: one
// descriptor change per tap and no gather.  B is the weight, repacked per tap by
// pack_weight.cu as [tap][n][k], streamed one tap of one chunk per pipeline step.
//
// The source is channels_last with 16-byte channel groups (an NCHW input is copied into
// that form first); the destination may be either layout.  Copies are cp.async into
// B_STAGES weight buffers and HALO_STAGES halo buffers, B_STAGES - 2 steps ahead, and
// each warpgroup keeps one step of MMAs in flight while the next step's copies land.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"
#include "cluster_copy.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int TILE_IMAGES = {{TILE_IMAGES}}, TILE_H = {{TILE_H}}, TILE_W = {{TILE_W}};
constexpr int WARPGROUPS = {{WARPGROUPS}};
constexpr int BN = {{BN}};
constexpr int CK = {{CK}};                   // input channels per chunk
constexpr int B_STAGES = {{B_STAGES}}, HALO_STAGES = {{HALO_STAGES}};
constexpr int HALO_H = {{HALO_H}}, HALO_W = {{HALO_W}};   // the widest phase's halo
constexpr bool DST_CL = {{DST_CL}};
constexpr bool HAS_BIAS = {{HAS_BIAS}};
// CTAs per cluster along the tiles.  With more than one, the CTAs of a cluster share each
// weight tile: each copies 1/CLUSTER of it and the copy engine multicasts it to all, which
// divides the weights' L2 traffic (the kernel's limit) by CLUSTER.  The weight is then
// packed tile by tile ([group][n tile][chunk][tap][16-byte group][n]) so a share is one
// contiguous bulk copy.
constexpr int CLUSTER = {{CLUSTER}};

constexpr int THREADS = 128 * WARPGROUPS;
constexpr int VEC = 16 / sizeof(scalar_t);     // channels in one 16-byte core-matrix row
constexpr int K_STEP = 32 / sizeof(scalar_t);  // channels one wgmma consumes
constexpr int CHUNK_GROUPS = CK / VEC;
constexpr int CHUNKS = (CIN_G + CK - 1) / CK;
constexpr int N_TILES = (COUT_G + BN - 1) / BN;
constexpr int N_PAD = N_TILES * BN, K_PAD = CHUNKS * CK;   // packed weight: [GROUPS][TAPS][N_PAD][K_PAD]
constexpr int BM = TILE_IMAGES * TILE_H * TILE_W;
constexpr int M_BLOCKS = BM / 64;                          // 64-row MMA blocks: 8 rows x 8 columns each
constexpr int MB = M_BLOCKS / WARPGROUPS;                  // per warpgroup
constexpr int COL_BLOCKS = TILE_W / 8, IMAGE_BLOCKS = TILE_H / 8 * COL_BLOCKS;
// Channel-group planes hold an odd number of 16-byte pixels, so the eight groups one
// pixel's copies write fall on different banks.
constexpr int IMAGE_HALO = HALO_H * HALO_W;
constexpr int HALO_PIXELS = TILE_IMAGES * IMAGE_HALO;
constexpr int HALO_PLANE = (HALO_PIXELS | 1) * 16;
constexpr int HALO_BYTES = CHUNK_GROUPS * HALO_PLANE;
constexpr int B_PLANE = CLUSTER > 1 ? BN * 16 : (BN + 1) * 16;   // cp.async stores: padded against bank conflicts
constexpr int B_BYTES = CHUNK_GROUPS * B_PLANE;
constexpr int HALO_VECS = CHUNK_GROUPS * HALO_PIXELS;
constexpr int B_VECS = CHUNK_GROUPS * BN;
constexpr int LOOKAHEAD = B_STAGES - 2;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "fp16 and bf16 so far (the stores move 16-bit values)");
static_assert(TILE_W % 8 == 0 && TILE_H % 8 == 0 && M_BLOCKS % WARPGROUPS == 0, "whole 64-row MMA blocks per warpgroup");
constexpr bool VECTOR_STORES = DST_CL && COUT_G % VEC == 0;   // whole 16-byte channel runs per pixel
// The epilogue stages the tile's outputs in the pipeline's buffers, padded by 16 bytes a line:
// as [row][channel] for channel runs, as [channel][row] for runs of pixels.
constexpr int OUT_PITCH = VECTOR_STORES ? BN + VEC : BM + VEC;
static_assert((VECTOR_STORES ? BM : BN) * OUT_PITCH * sizeof(scalar_t) <= HALO_STAGES * HALO_BYTES + B_STAGES * B_BYTES,
              "staging fits");
__device__ __forceinline__ int staged_at(int row, int channel) {
    return VECTOR_STORES ? row * OUT_PITCH + channel : channel * OUT_PITCH + row;
}
static_assert(CK % K_STEP == 0 && CIN_G % VEC == 0, "chunks of whole MMA steps, channels in whole 16-byte groups");
static_assert(B_STAGES >= 3 && HALO_STAGES >= 1, "pipeline depths");
static_assert(CHUNK_GROUPS % CLUSTER == 0 && CLUSTER <= 8, "whole 16-byte groups per CTA's share of a weight tile");
static_assert(HALO_STAGES * HALO_BYTES + B_STAGES * B_BYTES < (1 << 18), "descriptor addresses reach 256 KB");

struct Tap { int offset, w; };   // byte offset of the tap's origin in a halo plane; weight tap

extern "C" __global__ void __launch_bounds__(THREADS, 1) __cluster_dims__(CLUSTER, 1, 1)
conv_transpose2d_wgmma_forward(const scalar_t* __restrict__ src, const scalar_t* __restrict__ packed_weight,
                               const scalar_t* __restrict__ bias, scalar_t* __restrict__ dst,
                               index_t N, index_t H_SRC, index_t W_SRC, index_t H_DST, index_t W_DST) {
    extern __shared__ __align__(128) unsigned char smem[];   // HALO_STAGES halos, then B_STAGES weight tiles
    __shared__ Tap taps[TAPS];
    __shared__ int tap_count, min_dh, min_dw;
    __shared__ __align__(8) unsigned long long b_full[B_STAGES];   // weight tiles landed (CLUSTER > 1)

    const int tid = threadIdx.x;
    const int rh = static_cast<int>(blockIdx.z) / SW, rw = static_cast<int>(blockIdx.z) % SW;
    const index_t MH = rh < H_DST ? (H_DST - rh + SH - 1) / SH : 0;   // this phase's grid
    const index_t MW = rw < W_DST ? (W_DST - rw + SW - 1) / SW : 0;
    const index_t tiles_w = ((W_DST + SW - 1) / SW + TILE_W - 1) / TILE_W;   // phase 0's grid, the largest
    const index_t tiles_h = ((H_DST + SH - 1) / SH + TILE_H - 1) / TILE_H;
    const index_t tile = blockIdx.x;
    const index_t n0_image = tile / (tiles_w * tiles_h) * TILE_IMAGES;   // the tile's first image
    const index_t i0 = (tile / tiles_w % tiles_h) * TILE_H, j0 = tile % tiles_w * TILE_W;
    // A tile past the grid stores nothing; in a cluster it still runs, since its partners
    // copy weights into its shared memory and wait at its barriers.
    if (CLUSTER == 1 && (n0_image >= N || i0 >= MH || j0 >= MW)) return;
    const int g = blockIdx.y / N_TILES;
    const int n0 = (blockIdx.y % N_TILES) * BN;

    if (tid == 0) {
        // Two passes: the halo's origin is the smallest tap offset of the phase.
        int lo_h = 1 << 30, lo_w = 1 << 30;
        for (int pass = 0; pass < 2; ++pass) {
            int count = 0;
            for (int kh = 0; kh < KH; ++kh) {
                const int th = rh + PH - kh * DH;
                if (th % SH != 0) continue;
                for (int kw = 0; kw < KW; ++kw) {
                    const int tw = rw + PW - kw * DW;
                    if (tw % SW != 0) continue;
                    if (pass == 0) {
                        lo_h = min(lo_h, th / SH);
                        lo_w = min(lo_w, tw / SW);
                    } else {
                        taps[count] = Tap{((th / SH - lo_h) * HALO_W + tw / SW - lo_w) * 16, kh * KW + kw};
                    }
                    ++count;
                }
            }
            tap_count = count;
        }
        min_dh = lo_h;
        min_dw = lo_w;
        if constexpr (CLUSTER > 1) {
            for (int s = 0; s < B_STAGES; ++s) mbarrier_init(smem_addr(&b_full[s]), 1);
            fence_mbarrier_init();
        }
    }
    if constexpr (CLUSTER > 1) {
        cluster_arrive();   // every CTA's barriers exist before any copy lands on them
        cluster_wait();
    } else {
        __syncthreads();
    }
    const int tap_n = tap_count;
    const int steps = CHUNKS * tap_n;
    const index_t halo_i0 = i0 + min_dh, halo_j0 = j0 + min_dw;

    const unsigned smem_base = smem_addr(smem);
    auto halo_slot = [&](int c) { return smem_base + (c % HALO_STAGES) * HALO_BYTES; };
    auto b_slot = [&](int s) { return smem_base + HALO_STAGES * HALO_BYTES + (s % B_STAGES) * B_BYTES; };

    const index_t src_batch = H_SRC * W_SRC * CIN;
    const scalar_t* src_group = src + n0_image * src_batch + static_cast<index_t>(g) * CIN_G;
    const scalar_t* w_group = packed_weight + (static_cast<index_t>(g) * TAPS * N_PAD + n0) * K_PAD;
    const unsigned rank = CLUSTER > 1 ? cluster_rank() : 0;
    const scalar_t* w_tiles = packed_weight + (static_cast<index_t>(g) * N_PAD + n0) * TAPS * K_PAD;   // tiled packing

    // Step s multiplies tap s % tap_n of chunk s / tap_n; its copies are one commit group,
    // the chunk's halo riding with the chunk's first tap.
    auto issue = [&](int s) {
        if (s < steps) {
            const int c = s / tap_n, t = s % tap_n;
            if (t == 0) {
                const unsigned halo = halo_slot(c);
                for (int v = tid; v < HALO_VECS; v += THREADS) {
                    const int group = v % CHUNK_GROUPS, pixel = v / CHUNK_GROUPS;
                    const int image = pixel / IMAGE_HALO, at = pixel % IMAGE_HALO;
                    const index_t ih = halo_i0 + at / HALO_W, iw = halo_j0 + at % HALO_W;
                    const int k = c * CK + group * VEC;
                    const bool ok = n0_image + image < N && ih >= 0 && ih < H_SRC && iw >= 0 && iw < W_SRC
                                    && k < CIN_G;
                    const scalar_t* p = ok ? src_group + image * src_batch + (ih * W_SRC + iw) * CIN + k : src;
                    cp_async_16(halo + group * HALO_PLANE + pixel * 16, p, ok);
                }
            }
            const unsigned b = b_slot(s);
            if constexpr (CLUSTER > 1) {
                if (tid == 0) {
                    constexpr unsigned SHARE = B_BYTES / CLUSTER;
                    const unsigned bar = smem_addr(&b_full[s % B_STAGES]);
                    const scalar_t* tile = w_tiles + (static_cast<index_t>(c) * TAPS + taps[t].w) * CK * BN;
                    mbarrier_expect_bytes(bar, B_BYTES);
                    bulk_copy_multicast(b + rank * SHARE, reinterpret_cast<const char*>(tile) + rank * SHARE, SHARE,
                                        bar, static_cast<unsigned short>((1u << CLUSTER) - 1));
                }
            } else {
                const scalar_t* w_tap = w_group + static_cast<index_t>(taps[t].w) * N_PAD * K_PAD + c * CK;
                for (int v = tid; v < B_VECS; v += THREADS) {
                    const int group = v % CHUNK_GROUPS, row = v / CHUNK_GROUPS;
                    cp_async_16(b + group * B_PLANE + row * 16, w_tap + row * K_PAD + group * VEC, true);
                }
            }
        }
        cp_async_commit();   // empty groups keep the wait count uniform
    };

    float acc[MB][BN / 2];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[mb][i] = 0.f;

    const int warpgroup = tid / 128;
    // Byte offset of each of this warpgroup's 64-row blocks in a halo plane.
    unsigned block_offset[MB];
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
        const int b = warpgroup * MB + mb, at = b % IMAGE_BLOCKS;
        block_offset[mb] = (b / IMAGE_BLOCKS * IMAGE_HALO + (at / COL_BLOCKS) * 8 * HALO_W + (at % COL_BLOCKS) * 8) * 16;
    }

#pragma unroll
    for (int s = 0; s < LOOKAHEAD; ++s) issue(s);
    if constexpr (CLUSTER > 1) cluster_arrive();   // pairs with the first step's wait
    for (int s = 0; s < steps; ++s) {
        cp_async_wait<LOOKAHEAD - 1>();
        fence_async_shared();
        // Step s has landed for every thread, and every warpgroup has finished the MMAs of
        // step s - 2, whose buffers the next issue overwrites.
        __syncthreads();
        if constexpr (CLUSTER > 1) {
            mbarrier_wait(smem_addr(&b_full[s % B_STAGES]), (s / B_STAGES) & 1);
            cluster_wait();   // ... in every CTA of the cluster, whose buffers the next copies fill too
        }
        issue(s + LOOKAHEAD);
        const int c = s / tap_n, t = s % tap_n;
        const unsigned a_origin = halo_slot(c) + taps[t].offset, b_origin = b_slot(s);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < CK / K_STEP; ++kk) {
            const unsigned long long b_desc = smem_descriptor(b_origin + 2 * kk * B_PLANE, B_PLANE, 128);
#pragma unroll
            for (int mb = 0; mb < MB; ++mb) {
                const unsigned long long a_desc =
                    smem_descriptor(a_origin + block_offset[mb] + 2 * kk * HALO_PLANE, HALO_PLANE, HALO_W * 16);
                wgmma_async<KIND, BN>(acc[mb], a_desc, b_desc, 1);
            }
        }
        wgmma_commit();
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
        wgmma_wait<1>();
        if constexpr (CLUSTER > 1) cluster_arrive();   // this CTA is done with step s - 1
    }
    if constexpr (CLUSTER > 1) cluster_wait();
    wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) fence_registers(acc[mb]);
    cp_async_wait<0>();

    // Stage the tile as [row][channel] in the storage type, bias added, so that the stores
    // below write whole 16-byte channel runs (channels_last) or runs of neighbouring pixels.
    __syncthreads();   // every warpgroup is done reading the pipeline's buffers
    scalar_t* staged = reinterpret_cast<scalar_t*>(smem);
    const int lane = tid % 32, warp = tid % 128 / 32;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = (warpgroup * MB + mb) * 64 + warp * 16 + lane / 4 + h * 8;
#pragma unroll
            for (int jn = 0; jn < BN / 8; ++jn)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int oc = n0 + jn * 8 + (lane % 4) * 2 + q;
                    float v = acc[mb][jn * 4 + h * 2 + q];
                    if constexpr (HAS_BIAS) v += oc < COUT_G ? load(bias + g * COUT_G + oc) : 0.f;
                    store(staged + staged_at(row, jn * 8 + (lane % 4) * 2 + q), v);
                }
        }
    __syncthreads();

    const index_t dst_plane = H_DST * W_DST;
    scalar_t* dst_group = dst + n0_image * dst_plane * COUT
                          + static_cast<index_t>(g) * COUT_G * (DST_CL ? 1 : dst_plane);
    // Row r of the tile: image r / (64 * IMAGE_BLOCKS), then 64-row block, then 8 x 8 inside it.
    auto row_pixel = [&](int r, index_t& image, index_t& pixel, index_t& j) {
        const int b = r / 64, at = b % IMAGE_BLOCKS, in = r % 64;
        image = b / IMAGE_BLOCKS;
        const index_t i = i0 + (at / COL_BLOCKS) * 8 + in / 8;
        j = j0 + (at % COL_BLOCKS) * 8 + in % 8;
        pixel = (SH * i + rh) * W_DST + SW * j + rw;
        return n0_image + image < N && i < MH && j < MW;
    };
    if constexpr (VECTOR_STORES) {
        for (int v = tid; v < BM * (BN / VEC); v += THREADS) {
            const int r = v / (BN / VEC), cv = v % (BN / VEC);
            index_t image, pixel, j;
            if (!row_pixel(r, image, pixel, j) || n0 + cv * VEC >= COUT_G) continue;
            *reinterpret_cast<uint4*>(dst_group + (image * dst_plane + pixel) * COUT + n0 + cv * VEC) =
                *reinterpret_cast<const uint4*>(staged + staged_at(r, cv * VEC));
        }
    } else {
        // One value a thread, consecutive threads along a row of the tile: in NCHW a warp
        // writes two runs of neighbouring pixels of one channel.
        for (int v = tid; v < BN * BM; v += THREADS) {
            const int c = v / BM, at = v % BM;
            const int image = at / (TILE_H * TILE_W), ti = at / TILE_W % TILE_H, tj = at % TILE_W;
            const int r = (image * IMAGE_BLOCKS + ti / 8 * COL_BLOCKS + tj / 8) * 64 + ti % 8 * 8 + tj % 8;
            const index_t i = i0 + ti, j = j0 + tj;
            if (n0 + c >= COUT_G || n0_image + image >= N || i >= MH || j >= MW) continue;
            const index_t pixel = (SH * i + rh) * W_DST + SW * j + rw;
            dst_group[image * dst_plane * COUT + (DST_CL ? pixel * COUT + n0 + c : (n0 + c) * dst_plane + pixel)] =
                staged[staged_at(r, c)];
        }
    }
}
