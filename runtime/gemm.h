// The GEMM of library-GEMM kernels (CUDA, and the OpenCL test build): the extern stages that the
// model compiler emits call remat_gemm / remat_gemm_bias (gemm.cpp), which run one GemmCall on
// the CUDA device (cuBLASLt, cuda_device.cpp) or in host memory (a plain loop).
#pragma once

namespace remat {

// out[m, n] = sum_k A(m, k) B(k, n) (+ bias[n]) (+ out[m, n] when accumulate), all row-major
// and dense: A is a[m, k], or a[k, m] when trans_a; B is b[k, n], or b[n, k] when trans_b.
// Operands are fp32, or bf16 (uint16 bits) when bf16_in; out is fp32, or bf16 when bf16_out;
// bias (optional) has out's element type. Products accumulate in fp32.
struct GemmCall {
  const void *a = nullptr, *b = nullptr, *bias = nullptr;
  void *out = nullptr;
  int m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false, bf16_in = false, bf16_out = false, accumulate = false;
};

}  // namespace remat
