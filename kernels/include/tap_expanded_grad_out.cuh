// grad_output expanded by taps, for layers with few output channels: for input pixel p = (n, i, j), counted
// flat over the batch, and column c = tap * COUT + oc,
//   G[p][c] = grad_out[n, SH*i - PH + kh*DH, SW*j - PW + kw*DW, oc]     (zero outside the output image)
// so that both gradients are GEMMs with the taps in N or K, where the output channels alone are too few for a
// tensor-core tile:
//   grad_weight[ic][oc][tap] = sum over p of x[p][ic] * G[p][tap * COUT + oc]
//   grad_input[p][ic]        = sum over c of G[p][c] * weight[ic][oc][tap]
// The threads build a tile of TP consecutive pixels in shared memory from grad_out.  A thread takes whole
// (pixel, kernel row) runs: a run's KW * COUT values lie in one output row (a single stretch of memory where
// grad_out is channels_last and DW is 1; KW values in each of COUT planes where it is NCHW), so one pixel's
// decode serves them all.  Columns from EXPANDED up to EXPANDED_PAD are never written.
// Needs layer.cuh.
#pragma once

constexpr int EXPANDED = TAPS * COUT;
constexpr int EXPANDED_PAD = (EXPANDED + 15) / 16 * 16;   // whole k16 steps and pairs of n8 tiles

// The raw bits of one stored element: 16-bit types as unsigned short, float32 as unsigned.
template <int BYTES> struct RawBits;
template <> struct RawBits<2> { typedef unsigned short type; };
template <> struct RawBits<4> { typedef unsigned type; };
typedef RawBits<sizeof(scalar_t)>::type raw_t;

// A thread's share of one tile, held in registers between load() and store(): loads for the next tile go out
// before the current tile's MMAs and land while they run.  NCHW: grad_out's layout.
template <int TP, int THREADS, bool NCHW>
struct ExpandedTapsRuns {
    static_assert(sizeof(scalar_t) == 2 || sizeof(scalar_t) == 4, "the expanded tile holds 16- or 32-bit values");
    static constexpr int RUNS = (TP * KH + THREADS - 1) / THREADS;   // (pixel, kernel row) runs of a thread
    static constexpr int RUN = KW * COUT;
    raw_t values[RUNS][RUN];

    // Tile of pixels p0 .. p0 + TP - 1; pixels from `pixels` on are zero.
    __device__ __forceinline__ void load(const scalar_t* __restrict__ grad_out, index_t p0, index_t pixels, index_t H,
                                         index_t W, index_t H_out, index_t W_out) {
        const raw_t* src = reinterpret_cast<const raw_t*>(grad_out);
        // strides of a (kernel column, output channel) step from the run's first value
        const index_t kw_step = NCHW ? DW : DW * COUT, oc_step = NCHW ? H_out * W_out : 1;
#pragma unroll
        for (int r = 0; r < RUNS; ++r) {
            const int e = threadIdx.x + r * THREADS, q = e % TP, kh = e / TP;
            const index_t p = p0 + q;
            const index_t j = p % W, row = p / W;
            const index_t i = row % H, n = row / H;
            const index_t oh = i * SH - PH + kh * DH, ow0 = j * SW - PW;
            const bool row_ok = e < TP * KH && p < pixels && oh >= 0 && oh < H_out;
            // read only where the pixel is in range
            const index_t base = NCHW ? (n * COUT * H_out + oh) * W_out + ow0 : ((n * H_out + oh) * W_out + ow0) * COUT;
#pragma unroll
            for (int kw = 0; kw < KW; ++kw) {
                const index_t ow = ow0 + kw * DW;
                const bool ok = row_ok && ow >= 0 && ow < W_out;
#pragma unroll
                for (int oc = 0; oc < COUT; ++oc)
                    values[r][kw * COUT + oc] = ok ? __ldg(src + base + kw * kw_step + oc * oc_step)
                                                   : static_cast<raw_t>(0);
            }
        }
    }

    // put(q, c, bits) stores the raw bits of G[p0 + q][c].
    template <typename Put>
    __device__ __forceinline__ void store(Put&& put) const {
#pragma unroll
        for (int r = 0; r < RUNS; ++r) {
            const int e = threadIdx.x + r * THREADS, q = e % TP, kh = e / TP;
            if (e < TP * KH) {
#pragma unroll
                for (int v = 0; v < RUN; ++v) put(q, kh * RUN + v, values[r][v]);
            }
        }
    }
};
