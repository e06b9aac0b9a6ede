// The split-K grad_weight pass on CUDA cores, NCHW and channels_last alike: a thread
// walks the cells (CELLS adjacent input pixels of a row) of its chunk of (image, row)
// rows and, for each kernel row, multiplies the cell's inputs with the window of
// grad_output columns they meet.  Include after layer.cuh.
#pragma once

// Where the walk stands.  It moves on by a fixed number of cells a step, and carrying
// the position forward spares a division per step.
struct CellWalk {
    index_t n, ih, cell;  // image, row, cell of the row

    // Cell `offset` counted from the start of row r0, in images of H rows of cells_w cells.
    template <typename Offset>
    __device__ __forceinline__ CellWalk(index_t r0, Offset offset, index_t cells_w, index_t H)
        : n((r0 + offset / cells_w) / H), ih((r0 + offset / cells_w) % H), cell(offset % cells_w) {}

    // Moves on by rows * cells_w + cells cells, cells < cells_w.
    __device__ __forceinline__ void advance(index_t rows, index_t cells, index_t cells_w, index_t H) {
        cell += cells;
        ih += rows;
        if (cell >= cells_w) {
            cell -= cells_w;
            ++ih;
        }
        if (ih >= H) {
            n += ih / H;
            ih %= H;
        }
    }
};

// xv[i][c] = *element(i, c), input channel icg0 + i of the cell's pixel iw + c, zero past
// the group's channels, past the row's end or where the thread has no work at all.
template <int CHANNELS, int CELLS, typename Element>
__device__ __forceinline__ void read_cell(acc_t (&xv)[CHANNELS][CELLS], bool has_work, int icg0, index_t iw, index_t W,
                                          Element&& element) {
#pragma unroll
    for (int i = 0; i < CHANNELS; ++i)
#pragma unroll
        for (int c = 0; c < CELLS; ++c)
            xv[i][c] = has_work && icg0 + i < CIN_G && iw + c < W ? static_cast<acc_t>(load(element(i, c))) : acc_t(0);
}

// col_ok[j]: the cell at input column iw reads grad_output column iw * SW - PW + j,
// and it lies inside the output (only where the thread has work at all).
template <int COLS>
__device__ __forceinline__ void window_columns(bool (&col_ok)[COLS], index_t iw, index_t W_out, bool has_work) {
#pragma unroll
    for (int j = 0; j < COLS; ++j) {
        const index_t ow = iw * SW - PW + j;
        col_ok[j] = has_work && ow >= 0 && ow < W_out;
    }
}

// gv[j] = row[j * PIXEL_PITCH], the grad_output window of a kernel row, zero where the row
// or column j lies outside the output.
template <int PIXEL_PITCH, int COLS>
__device__ __forceinline__ void read_window(acc_t (&gv)[COLS], const scalar_t* row, bool row_ok, const bool (&col_ok)[COLS]) {
#pragma unroll
    for (int j = 0; j < COLS; ++j) gv[j] = row_ok && col_ok[j] ? static_cast<acc_t>(load(row + j * PIXEL_PITCH)) : acc_t(0);
}

// acc(i, kw) += xv[i][c] * gv[c * SW + kw * DW] for every kernel column kw, cell pixel c
// and input channel i: the products of one kernel row, gv being its grad_output window.
template <int CHANNELS, int CELLS, int COLS, typename Acc>
__device__ __forceinline__ void accumulate_row(Acc&& acc, const acc_t (&xv)[CHANNELS][CELLS], const acc_t (&gv)[COLS]) {
#pragma unroll
    for (int kw = 0; kw < KW; ++kw)
#pragma unroll
        for (int c = 0; c < CELLS; ++c)
#pragma unroll
            for (int i = 0; i < CHANNELS; ++i) acc(i, kw) += xv[i][c] * gv[c * SW + kw * DW];
}
