// An fp32 GEMM on AVX-512 for the attention's small tiles (gemm_f32_tiles.cpp): no packing (the
// operands are read where they lie; a transposed b is the caller's to make, once for many calls)
// and every element one chain of fused multiply-adds over k in order, so its bits depend on the
// values and k alone, not on the shape, the tile or the CPU.
#pragma once

namespace remat {

// True when the CPU (and the OS) run AVX-512 and REMAT_CPU_VARIANT does not force AVX2.
bool gemm_f32_tiles_available();

// c[m, n] = alpha (A B), or c + (A B) when add (alpha then 1), A = a[m, k] (a[k, m] when trans_a),
// B = b[k, n], row-major with leading dimensions lda, ldb, ldc. Element (i, j) of A B is
// fma(A(i, k-1), B(k-1, j), ... fma(A(i, 1), B(1, j), A(i, 0) B(0, j))). Needs
// gemm_f32_tiles_available().
void gemm_f32_tiles(bool trans_a, int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb,
                    bool add, float *c, int ldc);

// to[cols, rows] = x[rows, cols] transposed (row strides ldx, ldt): a b for gemm_f32_tiles from
// rows stored the other way. Needs gemm_f32_tiles_available().
void transpose_f32(int rows, int cols, const float *x, int ldx, float *to, int ldt);

}  // namespace remat
