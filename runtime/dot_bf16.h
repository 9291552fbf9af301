// A bf16 GEMM on AVX512_BF16's dot product instruction (dot_bf16.cpp), for the host GEMMs' bf16 panels
// on CPUs with AVX512_BF16 and without AMX (where MKL's bf16 GEMM runs at its fp32 rate).
#pragma once

#include <cstddef>
#include <cstdint>

namespace remat {

// The largest panel one call takes (the packing buffers, one pair a thread, made on the first call).
inline constexpr int dot_bf16_max_m = 512, dot_bf16_max_n = 512, dot_bf16_max_k = 512;

// True when the CPU (and the OS) run AVX-512 with AVX512_BF16 and the CPU has no AMX (there MKL's
// AMX kernels are faster), and REMAT_CPU_VARIANT does not force AVX2: the host GEMMs use the kernel.
bool dot_bf16_available();
// True when the kernel can run here (AVX-512 with AVX512_BF16, AMX or not): test_dot_bf16 checks it
// wherever it runs, not only where the GEMMs pick it.
bool dot_bf16_runs();

// c[m, n] = (c +) A B in fp32, A = a[m, k] (a[k, m] when trans_a), B = b[k, n] (b[n, k] when
// trans_b), bf16 operands, row-major with leading dimensions lda, ldb, ldc. Needs
// dot_bf16_runs(); m, n and k at most the maxima above.
void dot_bf16_gemm(bool trans_a, bool trans_b, int m, int n, int k, const std::uint16_t *a, int lda,
                   const std::uint16_t *b, int ldb, bool add, float *c, int ldc);

// b packed once for several products (dot_bf16_pack_b): micro-panels of 16 columns, each `pairs`
// k-pairs (32-bit words holding elements k and k + 1), zero past b's last column and depth.
struct DotPackedB {
  const std::uint32_t *words;
  int stride;  // k-pairs a micro-panel holds (its packed depth, halved and rounded up)
  int pairs;   // k-pairs from `words` on
  // From column j (a multiple of 16), or from depth k0 (even): the products of a part of b.
  DotPackedB columns_from(int j) const { return {words + std::size_t(j) * stride, stride, pairs}; }
  DotPackedB depth_from(int k0) const { return {words + std::size_t(k0 / 2) * 16, stride, pairs - k0 / 2}; }
};
// Words dot_bf16_pack_b writes for b [k, n].
inline std::size_t dot_bf16_packed_words(int n, int k) { return std::size_t((n + 15) / 16 * 16) * ((k + 1) / 2); }
void dot_bf16_pack_b(bool trans_b, int n, int k, const std::uint16_t *b, int ldb, std::uint32_t *packed);
// dot_bf16_gemm with b packed: its first n columns and k of its depth (k even, or the packed
// depth's last element among them: an odd k reads the pair after the last element, which must be
// the packing's zero). The same bits as dot_bf16_gemm of the same operands.
void dot_bf16_gemm_packed(bool trans_a, int m, int n, int k, const std::uint16_t *a, int lda, DotPackedB b, bool add,
                          float *c, int ldc);

}  // namespace remat
