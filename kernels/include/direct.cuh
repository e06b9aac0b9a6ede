// The gathers shared by the direct forward and grad_input kernels, NCHW and
// channels_last alike: a thread owns CELLS adjacent pixels of one row, reads each
// source row they need once into a register window that all their taps share, and
// takes its weights from shared memory, where the block stages them a chunk of
// channels at a time.  Include after layer.cuh.
#pragma once

// The source rows and columns of a thread's windows, bounds-tested once: window
// row a is source row first_row + a * ROW_STEP, window column j is source column
// first_col + j, in a plane whose neighbouring pixels are PIXEL_PITCH elements
// apart (1 in NCHW, the channel count in channels_last).
template <int ROWS, int COLS, int ROW_STEP, int PIXEL_PITCH>
struct Window {
    index_t row_offset[ROWS];
    bool row_ok[ROWS];
    index_t col_offset[COLS];
    bool col_ok[COLS];

    // An inactive thread (one that only helps stage weights) gets no rows, so it loads nothing.
    __device__ __forceinline__ Window(bool active, index_t first_row, index_t height, index_t first_col,
                                      index_t width) {
#pragma unroll
        for (int a = 0; a < ROWS; ++a) {
            const index_t row = first_row + a * ROW_STEP;
            row_ok[a] = active && row >= 0 && row < height;
            row_offset[a] = row * width * PIXEL_PITCH;
        }
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            const index_t col = first_col + j;
            col_ok[j] = col >= 0 && col < width;
            col_offset[j] = col * PIXEL_PITCH;
        }
    }

    // For each window row a: v[j] = plane[row a, column j] (zero outside the plane), then row(v, a).
    template <typename Row>
    __device__ __forceinline__ void for_each_row(const scalar_t* plane, Row&& row) const {
#pragma unroll
        for (int a = 0; a < ROWS; ++a) {
            acc_t v[COLS];
#pragma unroll
            for (int j = 0; j < COLS; ++j)
                v[j] = row_ok[a] && col_ok[j] ? static_cast<acc_t>(load(plane + row_offset[a] + col_offset[j])) : acc_t(0);
            row(v, a);
        }
    }
};

// Replaces the block's staged weights with rows ws[ch][kh][kw * LANES + l] =
// weight(ch, l, kh, kw), zero-padded to ROW (whole shared-memory vectors): ch counts
// the CHUNK channels staged at once, l the LANES channels a thread works on.
template <int CHUNK, int LANES, int ROW, int THREADS, typename Weight>
__device__ __forceinline__ void stage_weight_rows(acc_t* ws, Weight&& weight) {
    __syncthreads();  // every thread is done with the previous weights
    for (int e = threadIdx.x; e < CHUNK * KH * ROW; e += THREADS) {
        const int ch = e / (KH * ROW), kh = e / ROW % KH, kw = e % ROW / LANES, l = e % ROW % LANES;
        ws[e] = kw < KW ? weight(ch, l, kh, kw) : acc_t(0);
    }
    __syncthreads();
}

// Replaces the block's staged weights with ws[ch][tap][t] = weight(ch, tap, t): ch
// counts the CHUNK channels staged at once, t the TILE channels of the block's tile.
template <int CHUNK, int TILE, int THREADS, typename Weight>
__device__ __forceinline__ void stage_weight_taps(acc_t* ws, Weight&& weight) {
    __syncthreads();  // every thread is done with the previous weights
    for (int e = threadIdx.x; e < CHUNK * TAPS * TILE; e += THREADS)
        ws[e] = weight(e / (TAPS * TILE), e / TILE % TAPS, e % TILE);
    __syncthreads();
}
