// The forward's decomposition by stride phase, shared by its NCHW and channels_last
// kernels.  Output row oh belongs to phase rh = (oh + PH) % SH and low-resolution
// row q = (oh + PH) / SH; tap kh feeds only phase (kh*DH) % SH, reading input row
// q - (kh*DH) / SH (columns likewise).  A thread owns CELLS adjacent (q_h, q_w)
// cells and keeps acc[cell][rh][rw][channel] for all SH*SW outputs of each.
// Include after layer.cuh and direct.cuh.
#pragma once

constexpr int RH = ((KH - 1) * DH) / SH + 1;  // a cell reads input rows q_h - a, a < RH
constexpr int BW = ((KW - 1) * DW) / SW;      // and columns from q_w - BW to its own q_w

// acc[c][rh][rw][o] = value(o) for every cell and phase.
template <int CELLS, int CHANNELS, typename Value>
__device__ __forceinline__ void fill_phases(acc_t (&acc)[CELLS][SH][SW][CHANNELS], Value&& value) {
#pragma unroll
    for (int o = 0; o < CHANNELS; ++o) {
        const acc_t b = value(o);
#pragma unroll
        for (int c = 0; c < CELLS; ++c)
#pragma unroll
            for (int rh = 0; rh < SH; ++rh)
#pragma unroll
                for (int rw = 0; rw < SW; ++rw) acc[c][rh][rw][o] = b;
    }
}

// tap_row(xv, kh) for every kernel row kh, xv being the window of the input row it reads.
template <int COLS, int PIXEL_PITCH, typename TapRow>
__device__ __forceinline__ void for_each_tap_row(const Window<RH, COLS, -1, PIXEL_PITCH>& window, const scalar_t* plane,
                                                 TapRow&& tap_row) {
    window.for_each_row(plane, [&](const acc_t (&xv)[COLS], int a) {
#pragma unroll
        for (int kh = 0; kh < KH; ++kh) {
            if ((kh * DH) / SH != a) continue;
            tap_row(xv, kh);
        }
    });
}

// Adds tap (kh, kw) to every cell: xv is the input window of the tap's row (columns
// q_w - BW on), w the tap's weights of the thread's channels.
template <int CELLS, int CHANNELS, int COLS>
__device__ __forceinline__ void accumulate_tap(acc_t (&acc)[CELLS][SH][SW][CHANNELS], const acc_t (&xv)[COLS],
                                               const acc_t* w, int kh, int kw) {
#pragma unroll
    for (int c = 0; c < CELLS; ++c)
#pragma unroll
        for (int o = 0; o < CHANNELS; ++o) acc[c][(kh * DH) % SH][(kw * DW) % SW][o] += xv[BW + c - (kw * DW) / SW] * w[o];
}

// write(c, rh, rw, oh, ow) for every output pixel of the thread's cells (qh, qw + c)
// that lies inside the H_out x W_out output.
template <int CELLS, typename Write>
__device__ __forceinline__ void for_each_output(index_t qh, index_t qw, index_t H_out, index_t W_out, Write&& write) {
#pragma unroll
    for (int rh = 0; rh < SH; ++rh) {
        const index_t oh = qh * SH + rh - PH;
        if (oh < 0 || oh >= H_out) continue;
#pragma unroll
        for (int c = 0; c < CELLS; ++c)
#pragma unroll
            for (int rw = 0; rw < SW; ++rw) {
                const index_t ow = (qw + c) * SW + rw - PW;
                if (ow < 0 || ow >= W_out) continue;
                write(c, rh, rw, oh, ow);
            }
    }
}
