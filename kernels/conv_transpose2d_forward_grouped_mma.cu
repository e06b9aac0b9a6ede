// Forward of a grouped transposed convolution with few channels a group, on mma.sync
// tensor cores, channels_last 16-bit data.
//
// Output column q * SW + r (stride phase r) receives kernel column kw from input column
// q + column_offset(r, kw) wherever column_tap(r, kw): for a run of 16 adjacent q of one
// phase, a tap's input pixels are 16 adjacent staged rows, which is an mma's A operand
// (ldmatrix, a row a pixel, its 8 input channels a row).  A block takes a segment of
// SEGQ q of one output row for GROUPS_PER_BLOCK whole groups: it stages the input
// rows the output row's kernel rows meet, once, runs every phase's 16-pixel tiles over
// their taps (m16n8k8: 8 input channels a K step, 8 output channels an N tile), and
// writes the segment's output through shared memory, zeros and bias included where no
// tap reaches: channels_last output in 16-byte channel runs, NCHW output (OUT_NCHW; the
// input then is a channels_last copy) in runs of adjacent pixels of each channel.  The
// block's weights stay in shared memory as [group][tap][output channel][input channel]
// for every item it walks, and the next item's input rows are copied in while the block
// computes this one.
#include "layer.cuh"
#include "mma.cuh"
#include "cp_async_pipeline.cuh"

constexpr int KIND = {{MMA_KIND}};
constexpr bool HAS_BIAS = {{HAS_BIAS}};
constexpr int GROUPS_PER_BLOCK = {{GROUPS_PER_BLOCK}};
constexpr int SEGQ = {{SEGQ}};    // output columns of each phase a block computes at once, in whole 16-column tiles
constexpr int WARPS = {{WARPS}};
constexpr bool OUT_NCHW = {{OUT_NCHW}};
constexpr int THREADS = WARPS * 32;
constexpr int N_TILES = COUT_G / 8, K_STEPS = CIN_G / 8, TILES = SEGQ / 16;

__host__ __device__ constexpr bool column_tap(int r, int kw) { return ((r + PW - kw * DW) % SW + SW) % SW == 0; }
__host__ __device__ constexpr int column_offset(int r, int kw) { return (r + PW - kw * DW) / SW; }  // exact: a tap
__host__ __device__ constexpr int offset_bound(bool upper) {
    int found = 0;
    bool any = false;
    for (int r = 0; r < SW; ++r)
        for (int kw = 0; kw < KW; ++kw)
            if (column_tap(r, kw) && (!any || (upper ? column_offset(r, kw) > found : column_offset(r, kw) < found))) {
                found = column_offset(r, kw);
                any = true;
            }
    return found;
}
constexpr int OFF_MIN = offset_bound(false), OFF_MAX = offset_bound(true);
constexpr int XSPAN = SEGQ + OFF_MAX - OFF_MIN;  // input columns a segment's taps read
// Staged rows in 16-byte units (8 channels); odd pitches keep ldmatrix's eight rows on distinct banks.
constexpr int X_UNITS = GROUPS_PER_BLOCK * CIN_G / 8, O_UNITS = GROUPS_PER_BLOCK * COUT_G / 8;
constexpr int X_PITCH = X_UNITS | 1, O_PITCH = O_UNITS | 1;
// Bytes of a staged output pixel: whole 16-byte units for the channels_last stores; an odd number of words for the
// NCHW stores, whose lanes read adjacent pixels of one channel.
constexpr int O_ROW = OUT_NCHW ? O_UNITS * 16 + 4 : O_PITCH * 16;
constexpr int X_BYTES = KH * XSPAN * X_PITCH * 16;
constexpr int W_ELEMS = GROUPS_PER_BLOCK * TAPS * COUT_G * CIN_G;
constexpr int W_BYTES = (W_ELEMS * 2 + 15) / 16 * 16;
constexpr int B_BYTES = (GROUPS_PER_BLOCK * COUT_G * 4 + 15) / 16 * 16;

static_assert(KIND == MMA_F16 || KIND == MMA_BF16, "16-bit operands");
static_assert(CIN_G % 8 == 0 && COUT_G % 8 == 0, "whole 8-channel K steps and N tiles");
static_assert(SEGQ % 16 == 0, "whole 16-column tiles");
static_assert(SW <= 8, "a warp's tile walks every stride phase unrolled");

extern "C" __global__ void __launch_bounds__(THREADS)
conv_transpose2d_forward_grouped_mma(const scalar_t* __restrict__ x, const scalar_t* __restrict__ w,
                                     const scalar_t* __restrict__ bias, scalar_t* __restrict__ out,
                                     index_t N, index_t H, index_t W, index_t H_out, index_t W_out, index_t segs) {
    // two [KH][XSPAN][X_PITCH] stages of input rows, the weights, the bias, then SW * SEGQ output pixels of O_ROW bytes
    extern __shared__ __align__(16) unsigned char staged[];
    unsigned short* ws = reinterpret_cast<unsigned short*>(staged + 2 * X_BYTES);
    float* bs = reinterpret_cast<float*>(staged + 2 * X_BYTES + W_BYTES);
    unsigned char* os = staged + 2 * X_BYTES + W_BYTES + B_BYTES;
    const unsigned x_base = smem_addr(staged);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g0 = blockIdx.y * GROUPS_PER_BLOCK;
    const int groups_here = GROUPS - g0 < GROUPS_PER_BLOCK ? GROUPS - g0 : GROUPS_PER_BLOCK;
    const int x_units = groups_here * CIN_G / 8, o_units = groups_here * COUT_G / 8;

    for (int v = tid; v < W_ELEMS; v += THREADS) {
        const int ic = v % CIN_G, oc = v / CIN_G % COUT_G, tap = v / (CIN_G * COUT_G) % TAPS;
        const int group = g0 + v / (CIN_G * COUT_G * TAPS);
        ws[v] = group < GROUPS ? w[weight_index(static_cast<index_t>(group) * CIN_G + ic, oc, tap)].bits : 0;
    }
    for (int v = tid; v < GROUPS_PER_BLOCK * COUT_G; v += THREADS)
        bs[v] = HAS_BIAS && v < groups_here * COUT_G ? static_cast<float>(load(bias + g0 * COUT_G + v)) : 0.f;

    // Which kernel rows reach output row oh, and from which input rows.
    auto rows_of = [&](index_t oh, bool (&row_ok)[KH], index_t (&ih)[KH]) {
#pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
            const index_t t = oh + PH - kh * DH;
            ih[kh] = t / SH;
            row_ok[kh] = t >= 0 && t % SH == 0 && ih[kh] < H;
        }
    };
    // Starts the copies of an item's input rows into stage s (one commit group, empty past the last item).
    auto issue = [&](index_t item, int s) {
        if (item < N * H_out * segs) {
            const index_t row = item / segs, q0 = (item % segs) * SEGQ;
            const index_t n = row / H_out;
            bool row_ok[KH];
            index_t ih[KH];
            rows_of(row % H_out, row_ok, ih);
#pragma unroll
            for (int kh = 0; kh < KH; ++kh) {
                if (!row_ok[kh]) continue;  // the same for the whole block
                for (int v = tid; v < XSPAN * X_UNITS; v += THREADS) {
                    const int p = v / X_UNITS, u = v % X_UNITS;
                    const index_t iw = q0 + OFF_MIN + p;
                    const bool ok = iw >= 0 && iw < W && u < x_units;
                    cp_async_16(x_base + s * X_BYTES + ((kh * XSPAN + p) * X_PITCH + u) * 16,
                                ok ? x + ((n * H + ih[kh]) * W + iw) * CIN + g0 * CIN_G + u * 8 : x, ok);
                }
            }
        }
        cp_async_commit();
    };

    const index_t items = N * H_out * segs;
    issue(blockIdx.x, 0);
    int s = 0;
    for (index_t item = blockIdx.x; item < items; item += gridDim.x, s ^= 1) {
        // The next item's rows land while this one computes; its stage held the item before this one, which every
        // warp finished reading before the last __syncthreads.
        issue(item + gridDim.x, s ^ 1);
        const index_t row = item / segs, q0 = (item % segs) * SEGQ;
        const index_t n = row / H_out, oh = row % H_out;
        bool row_ok[KH];
        index_t ih[KH];
        rows_of(oh, row_ok, ih);
        cp_async_wait<1>();
        __syncthreads();

        const unsigned x_stage = x_base + s * X_BYTES;
        // A warp takes a 16-column tile of one group through every phase in turn: the phase loop unrolls, so only
        // the taps that reach a phase are compiled into it.
        for (int task = warp; task < GROUPS_PER_BLOCK * TILES; task += WARPS) {
            const int local_group = task / TILES, tile = task % TILES;
            if (local_group >= groups_here) continue;  // past the layer's groups: nothing of it is stored
            const unsigned a_rows = x_stage + ((tile * 16 - OFF_MIN + (lane & 15)) * X_PITCH + local_group * K_STEPS) * 16;
            const unsigned short* w_group = ws + (local_group * TAPS * COUT_G + lane / 4) * CIN_G + (lane % 4) * 2;
            unsigned char* o_tile = os + (tile * 16 + lane / 4) * SW * O_ROW
                                    + (local_group * COUT_G + (lane % 4) * 2) * 2;
            const float* b_lane = bs + local_group * COUT_G + (lane % 4) * 2;
#pragma unroll
            for (int r = 0; r < SW; ++r) {
                float acc[N_TILES][4] = {};
#pragma unroll
                for (int kh = 0; kh < KH; ++kh) {
                    if (!row_ok[kh]) continue;  // the same for the whole block
#pragma unroll
                    for (int kw = 0; kw < KW; ++kw) {
                        if (!column_tap(r, kw)) continue;  // known at compile time once unrolled
                        const unsigned a_tap = a_rows + (kh * XSPAN + column_offset(r, kw)) * X_PITCH * 16;
                        const unsigned short* w_tap = w_group + (kh * KW + kw) * COUT_G * CIN_G;
#pragma unroll
                        for (int ks = 0; ks < K_STEPS; ++ks) {
                            unsigned a[2];
                            ldmatrix_x2(a, a_tap + ks * 16);
#pragma unroll
                            for (int nt = 0; nt < N_TILES; ++nt)
                                mma_16x8x8<KIND>(acc[nt], a, *reinterpret_cast<const unsigned*>(w_tap + nt * 8 * CIN_G + ks * 8));
                        }
                    }
                }
                // C fragment: rows (columns q) lane / 4 and lane / 4 + 8 of the tile, output channels 2 (lane % 4)
                // + {0, 1} of each N tile; output pixel q * SW + r of the segment.
#pragma unroll
                for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        *reinterpret_cast<unsigned*>(o_tile + (h * 8 * SW + r) * O_ROW + nt * 16) =
                            pack_pair<scalar_t>(acc[nt][2 * h] + b_lane[nt * 8], acc[nt][2 * h + 1] + b_lane[nt * 8 + 1]);
            }
        }
        __syncthreads();
        if (OUT_NCHW) {
            scalar_t* out_rows = out + ((n * COUT + g0 * COUT_G) * H_out + oh) * W_out + q0 * SW;
            const index_t pixels = W_out - q0 * SW < SW * SEGQ ? W_out - q0 * SW : SW * SEGQ;
            for (int v = tid; v < SW * SEGQ * o_units * 8; v += THREADS) {
                const int p = v % (SW * SEGQ), c = v / (SW * SEGQ);
                if (p < pixels)
                    out_rows[static_cast<index_t>(c) * H_out * W_out + p] =
                        *reinterpret_cast<const scalar_t*>(os + p * O_ROW + c * 2);
            }
        } else {
            scalar_t* out_row = out + (n * H_out + oh) * W_out * COUT + g0 * COUT_G;
            for (int v = tid; v < SW * SEGQ * O_UNITS; v += THREADS) {
                const int p = v / O_UNITS, u = v % O_UNITS;
                const index_t ow = q0 * SW + p;
                if (ow < W_out && u < o_units)
                    *reinterpret_cast<uint4*>(out_row + ow * COUT + u * 8) = *reinterpret_cast<const uint4*>(os + p * O_ROW + u * 16);
            }
        }
        // The next iteration writes the output stage only after its first __syncthreads, once these reads are done.
    }
    cp_async_wait<0>();
}
