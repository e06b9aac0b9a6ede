// grad_input of a transposed convolution of one group as one implicit GEMM over every tap on Hopper's warpgroup
// MMA (wgmma, sm_90a), the scatter GEMM's forward transposed:
//   dX[m][n] = sum_k dY(m, k) * W[n][k],  m = input pixel (image, i, j), n = input channel,
//   k = (tap, output channel) in a channels_last weight's order (C_in, KH, KW, C_out),
// where dY(m, k) is grad_output's channels_last pixel (SH*i + DH*kh - PH, SW*j + DW*kw - PW), zero where the
// padding cropped it.  Where every grad_output pixel is one tap of one input pixel (kernel == stride, as in
// U-Net's 2 x 2 stride-2 upsampling; a 1 x 1 input; 1 x 1 kernels) A's gather reads grad_output once per column
// tile; where taps overlap (DCGAN's and pix2pix's 4 x 4 stride-2 layers) a pixel is read once for each tap that
// lands on it, neighbouring rows of a tile sharing it through L2.  A's rows come in runs of a pixel's channels;
// B is the weight as it lies, K-major, one copy-engine box a step.  A contiguous weight is copied into the
// channels_last order first, an NCHW grad_output into channels_last scratch; float32 operands come through
// copies that round them to TF32 (the tensor cores would truncate them), but with A_IN_PLACE a channels_last
// grad_output, which the consumers round as they take A from shared memory into registers.
//
// The block is pingpong_gemm.cuh's: persistent over tiles of BM input pixels (BOX_N images of BOX_H x BOX_W)
// x BN input channels, a producer warpgroup filling a ring of CK-column steps and two consumer warpgroups
// taking the tiles in turn, one storing while the other multiplies.
#include "layer.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "cp_async_pipeline.cuh"
#include "mbarrier_copy.cuh"
#include "pingpong_gemm.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr int MB = {{MB}};            // 64-row MMA blocks per tile: BM = 64 * MB input pixels
constexpr int BN = {{BN}};            // input channels per tile
constexpr int STAGES = {{STAGES}};
constexpr bool DST_CL = {{DST_CL}};
constexpr bool A_BOXES = {{A_BOXES}};   // A lands as copy-engine boxes of grad_output (grad_out_map)
constexpr int BOX_W = {{BOX_W}}, BOX_H = {{BOX_H}};   // a tile's pixels: BOX_N images of BOX_H x BOX_W
constexpr bool A_IN_PLACE = {{A_IN_PLACE}};   // TF32: A lands unrounded, the MMAs take it from registers

constexpr int VEC = 16 / sizeof(scalar_t);     // elements in 16 bytes
constexpr int CK = 128 / sizeof(scalar_t);     // columns of (tap, output channel) a step: one 128-byte row (64
                                               // 16-bit values, 32 float32 ones)
constexpr int K_TOTAL = TAPS * COUT;
constexpr int K_STEPS = (K_TOTAL + CK - 1) / CK;
constexpr int N_TILES = (CIN + BN - 1) / BN;
// The cp.async producer keeps each of its rows' grad_output offsets (and landing taps, with CROPS) for a whole
// tile; 88 registers leave the consumers 208, as 80 would.
typedef PingPongGemm<KIND, MB, BN, STAGES, K_STEPS, N_TILES, false, 88, A_IN_PLACE> Gemm;
constexpr int BM = Gemm::BM;
constexpr int BOX_N = BM / (BOX_W * BOX_H);
constexpr int A_COPIES = BM / 16;              // a producer thread's 16-byte copies of A per step (8 a row)
// Whether a tap may land in the cropped border: without padding the last input pixel's last tap lands on
// grad_output's last pixel but output_padding, the first one's first on its first.
constexpr bool CROPS = PH > 0 || PW > 0;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16 || KIND == MMA_TF32,
              "fp16 or bf16, or float32 words rounded to TF32 (both operands K-major)");
static_assert(GROUPS == 1 && WEIGHT_CL, "one group; the weight in channels_last order");
static_assert(COUT % VEC == 0 && CIN % 2 == 0,
              "16-byte runs of output channels within a tap; input channel pairs");
static_assert(Gemm::A_BYTES % 1024 == 0 && Gemm::STAGE_BYTES % 1024 == 0, "boxes land 1024-byte aligned");
static_assert(!CROPS || A_BOXES || (KH <= 16 && KW <= 16), "a row's landing taps as two 16-bit masks");
static_assert(BOX_N * BOX_H * BOX_W == BM, "a tile's pixels fill its rows");
static_assert(!A_BOXES || (COUT % CK == 0 && SH <= 8 && SW <= 8 && SW * BOX_W <= 256 && SH * BOX_H <= 256),
              "a step within one tap; the copy engine's traversal strides and box sides");

// A tile's BM pixels: BOX_N images x BOX_H rows x BOX_W columns from its origin, row r of the tile being pixel
// (r / (BOX_H BOX_W), r / BOX_W % BOX_H, r % BOX_W) past it.  The tiles of a row of an image come first, then the
// rows, then the images; pixels past the edges are rows whose results no store keeps.
struct PixelTiles {
    index_t N;
    int H, W, across, down;   // tiles along an image row, and down an image

    __device__ __forceinline__ PixelTiles(index_t n, index_t h, index_t w)
        : N(n), H(static_cast<int>(h)), W(static_cast<int>(w)), across(static_cast<int>((w + BOX_W - 1) / BOX_W)),
          down(static_cast<int>((h + BOX_H - 1) / BOX_H)) {}

    __device__ __forceinline__ index_t count() const { return (N + BOX_N - 1) / BOX_N * down * across; }

    // The origin of the tile whose first GEMM row is m0.
    __device__ __forceinline__ void origin(index_t m0, index_t& n, int& i, int& j) const {
        index_t t = m0 / BM;
        j = static_cast<int>(t % across) * BOX_W;
        t /= across;
        i = static_cast<int>(t % down) * BOX_H;
        n = t / down * BOX_N;
    }

    // Row r's pixel from the tile's origin; false past the layer's edges.
    __device__ __forceinline__ bool pixel(int r, index_t& n, int& i, int& j) const {
        n += r / (BOX_H * BOX_W);
        i += r / BOX_W % BOX_H;
        j += r % BOX_W;
        return n < N && i < H && j < W;
    }
};

template <bool BOXES> struct GatherProducer;

// Thread ptid copies vector ptid % 8 of A's rows ptid / 8 + 16 q (input pixels, their taps gathered), for layers
// whose steps cross taps or whose strides the copy engine cannot walk.  A row's pixel is worked out once a tile:
// the element offset in grad_output where its tap (0, 0) lands, and with CROPS which kernel rows (low 16 bits)
// and columns (high 16) land inside grad_output, as a mask (the producer keeps few registers; zero for a row past
// the edges).  B, the weight's BN rows of the step's CK columns, is one box of the copy engine (TMA), issued by
// the first producer thread: the producer's issue rate held the kernel while every thread copied B as well.
template <>
struct GatherProducer<false> {
    static constexpr bool CP_ASYNC = true;
    static constexpr int FULL_ARRIVALS = 128 + 1;   // each thread's cp.asyncs, and the weight box's bytes
    const scalar_t* __restrict__ grad_out;
    const TensorMap* weight_map;
    PixelTiles tiles;
    index_t H_OUT, W_OUT;
    int vec, row0;
    index_t base[A_COPIES];
    unsigned landing[CROPS ? A_COPIES : 1];
    int n0;

    __device__ __forceinline__ GatherProducer(const scalar_t* g, const TensorMap*, const TensorMap* w,
                                              const PixelTiles& t, index_t h_out, index_t w_out, int ptid)
        : grad_out(g), weight_map(w), tiles(t), H_OUT(h_out), W_OUT(w_out), vec(ptid % 8), row0(ptid / 8) {}

    // Bits k of [0, taps) for which 0 <= origin + k * dilation < size.
    static __device__ __forceinline__ unsigned inside(int origin, int taps, int dilation, index_t size) {
        unsigned bits = 0;
#pragma unroll
        for (int k = 0; k < taps; ++k) {
            const int at = origin + k * dilation;
            bits |= (at >= 0 && at < size) ? 1u << k : 0u;
        }
        return bits;
    }

    __device__ __forceinline__ void tile(index_t m0, int n) {
        n0 = n;
        index_t image0;
        int i0, j0;
        tiles.origin(m0, image0, i0, j0);
#pragma unroll
        for (int q = 0; q < A_COPIES; ++q) {
            index_t image = image0;
            int i = i0, j = j0;
            const bool inside_layer = tiles.pixel(row0 + 16 * q, image, i, j);
            const int oh = SH * i - PH, ow = SW * j - PW;
            base[q] = inside_layer ? ((image * H_OUT + oh) * W_OUT + ow) * COUT : -1;
            if constexpr (CROPS)
                landing[q] = inside_layer ? inside(oh, KH, DH, H_OUT) | inside(ow, KW, DW, W_OUT) << 16 : 0u;
        }
    }

    __device__ __forceinline__ void step(unsigned a, unsigned b, int c, unsigned full) {
        if (threadIdx.x % 128 == 0) {
            // columns past K_TOTAL and rows past CIN land as zeros, and count as bytes
            mbarrier_expect_bytes(full, Gemm::B_BYTES);
            tensor_copy_4d(b, *weight_map, c * CK, n0, 0, 0, full);
        }
        const int k = c * CK + vec * VEC;
        const int tap = k / COUT, oc = k % COUT, kh = tap / KW, kw = tap % KW;
        const bool column = k < K_TOTAL;
        // past K_TOTAL kh may pass KH by the step's overshoot (under 8 taps), so the shifts stay under 32
        const unsigned lands = CROPS ? 1u << kh | 1u << (16 + kw) : 0u;
        const index_t from_tap = (static_cast<index_t>(DH * kh) * W_OUT + DW * kw) * COUT + oc;
#pragma unroll
        for (int q = 0; q < A_COPIES; ++q) {
            bool ok;
            if constexpr (CROPS) ok = column && (landing[q] & lands) == lands;
            else ok = column && base[q] >= 0;
            cp_async_16(swizzle_128b(a + (row0 + 16 * q) * 128 + vec * 16), ok ? grad_out + base[q] + from_tap : grad_out,
                        ok);
        }
    }
};

// One producer thread copies a step as two copy-engine boxes: A, the tile's pixels' tap of the step, walked at
// the stride through grad_output (BOX_N images x BOX_H x BOX_W pixels x CK channels: a step never crosses taps),
// where coordinates the padding crops or past the edges land as zeros; B, the weight's BN rows of the step's CK
// columns.
template <>
struct GatherProducer<true> : CopyEngineProducer {
    const TensorMap* grad_out_map;
    const TensorMap* weight_map;
    PixelTiles tiles;
    index_t image0;
    int i0, j0, n0;

    __device__ __forceinline__ GatherProducer(const scalar_t*, const TensorMap* g, const TensorMap* w,
                                              const PixelTiles& t, index_t, index_t, int)
        : grad_out_map(g), weight_map(w), tiles(t) {}

    __device__ __forceinline__ void tile(index_t m0, int n) {
        n0 = n;
        tiles.origin(m0, image0, i0, j0);
    }

    __device__ __forceinline__ void step(unsigned a, unsigned b, int c, unsigned full) {
        if (threadIdx.x % 128 != 0) return;
        const int tap = c * CK / COUT, oc = c * CK % COUT;
        mbarrier_expect_bytes(full, Gemm::STAGE_BYTES);
        tensor_copy_4d(a, *grad_out_map, oc, SW * j0 + DW * (tap % KW) - PW, SH * i0 + DH * (tap / KW) - PH,
                       static_cast<int>(image0), full);
        tensor_copy_4d(b, *weight_map, c * CK, n0, 0, 0, full);
    }
};

// Each column pair (jn, lane % 4) is two neighbouring input channels; each row one input pixel.
struct GatherStore {
    scalar_t* __restrict__ dst;
    PixelTiles tiles;

    struct Row {
        bool keep;
        index_t image, pixel;
    };

    __device__ __forceinline__ void operator()(float (&acc)[MB][BN / 2], index_t m0, int n0) const {
        index_t image0;
        int i0, j0;
        tiles.origin(m0, image0, i0, j0);
        const index_t plane = static_cast<index_t>(tiles.H) * tiles.W;
        Gemm::store_pairs(acc, [&](int r) {
            index_t image = image0;
            int i = i0, j = j0;
            const bool keep = tiles.pixel(r, image, i, j);
            return Row{keep, image, static_cast<index_t>(i) * tiles.W + j};
        }, [&](const Row& at, int n, float v0, float v1) {
            const int ic = n0 + n;
            if (ic >= CIN) return;
            if constexpr (DST_CL) {
                store_pair(dst + (at.image * plane + at.pixel) * CIN + ic, v0, v1);   // channel pairs: whole words
            } else {
                scalar_t* out = dst + (at.image * CIN + ic) * plane + at.pixel;
                store(out, v0);
                store(out + plane, v1);
            }
        });
    }
};

#if {{A_BOXES}}
#define GRAD_OUT_MAP , const __grid_constant__ TensorMap grad_out_map
#define GRAD_OUT_MAP_ADDRESS &grad_out_map
#else
#define GRAD_OUT_MAP
#define GRAD_OUT_MAP_ADDRESS nullptr
#endif

// The pass's pointers are (grad_output, weight, out) after a PackedGemm's copies, launched as the forward's
// (source, weight, bias, destination): `unused` is the bias slot.  The weight is read through `weight_map`, and
// with A_BOXES grad_output through `grad_out_map`: the host's encodings of those pointers.
extern "C" __global__ void __launch_bounds__(Gemm::THREADS, 1)
conv_transpose2d_gather_gemm(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ weight,
                             const scalar_t* __restrict__ unused, scalar_t* __restrict__ dst,
                             index_t N, index_t H_IN, index_t W_IN, index_t H_OUT, index_t W_OUT,
                             const __grid_constant__ TensorMap weight_map GRAD_OUT_MAP) {
    // STAGES x (A tile, then B tile), each 1024-byte aligned as the copy engine's 128-byte swizzle needs
    extern __shared__ __align__(1024) unsigned char smem[];
    const PixelTiles tiles(N, H_IN, W_IN);
    GatherProducer<A_BOXES> producer(grad_out, GRAD_OUT_MAP_ADDRESS, &weight_map, tiles, H_OUT, W_OUT,
                                     threadIdx.x % 128);
    GatherStore store{dst, tiles};
    Gemm::run(smem, tiles.count() * N_TILES, producer, store);
}
