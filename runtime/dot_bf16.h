// A bf16 GEMM on AVX512_BF16's dot product instruction (dot_bf16.cpp), for the host GEMMs' bf16 panels
// on CPUs with AVX512_BF16 and without AMX (where MKL's bf16 GEMM runs at its fp32 rate).
#pragma once

#include <cstdint>

namespace remat {

// The largest panel one call takes (the packing buffers, one pair a thread, made on the first call).
inline constexpr int dot_bf16_max_m = 512, dot_bf16_max_n = 512, dot_bf16_max_k = 512;

// True when the CPU (and the OS) run AVX-512 with AVX512_BF16 and the CPU has no AMX.
bool dot_bf16_available();

// c[m, n] = (c +) A B in fp32, A = a[m, k] (a[k, m] when trans_a), B = b[k, n] (b[n, k] when
// trans_b), bf16 operands, row-major with leading dimensions lda, ldb, ldc. Needs
// dot_bf16_available(); m, n and k at most the maxima above.
void dot_bf16_gemm(bool trans_a, bool trans_b, int m, int n, int k, const std::uint16_t *a, int lda,
                   const std::uint16_t *b, int ldb, bool add, float *c, int ldc);

}  // namespace remat
