// The GEMM of library-GEMM kernels (fp32 CPU kernels, CUDA, and the OpenCL test build): the extern
// stages that the model compiler emits call remat_gemm / remat_gemm_bias (gemm.cpp), which run one
// GemmCall on the CUDA device (cuBLASLt, cuda_device.cpp) or in host memory (MKL).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

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

// The call's shape, types, transposes, leading dimensions and epilogue, for error messages, e.g.
// "m=4096 n=2304 k=768, a bf16 [m, k] ld 768, b bf16 [n, k] (trans_b) ld 768, out fp32 ld 2304,
// epilogue bias, beta 0".
std::string describe(const GemmCall &g);

// cuBLASLt picks its algorithm from the alignment it may assume, so every GEMM assumes the same
// one (operands of any plan's layout then get the same algorithm, hence the same bits) and
// operands below it are refused. The planner puts every arena tensor on a 64-byte boundary.
inline constexpr std::size_t gemm_alignment = 16;
// The largest power of two (at most 256) that divides the address.
std::size_t address_alignment(const void *p);
// Throws, naming the operand and its alignment, unless a, b, out and bias (when present) are
// gemm_alignment-byte aligned.
void require_gemm_alignment(const GemmCall &g);

// One GEMM in host memory: sequential MKL's sgemm, or for bf16 operands remat's AVX512_BF16 kernel
// (dot_bf16.h) or MKL's gemm_bf16bf16f32, in bands on Halide's threads (of rows; of columns where
// n >= 8 m).
void host_gemm(const GemmCall &g);
// The threads the bands run on (Halide's count; set by gemm_warm_up).
int gemm_thread_count();
// What runs host GEMMs of bf16 operands on this CPU: "AVX512_BF16 dot product (dot_bf16.cpp)" or
// "MKL gemm_bf16bf16f32".
const char *bf16_gemm_kernel();
// Runs MKL once per transpose case on every Halide thread (once per process; the executor calls
// it on the CPU and for OpenCL, not for CUDA), so that the buffers MKL keeps per thread exist
// before any training step.
void gemm_warm_up();

// Which library kernel ran a host product: with REMAT_PROFILE set, every call of MKL, remat's bf16
// dot kernel or its fp32 tiles (the GEMM glue's bands and panels, the attention's products) is
// tallied by kernel, shape and transposes in a fixed table (no heap: it is filled inside steps);
// `library_calls` lists them, the executor's profile prints them.
enum class Library { mkl_sgemm, mkl_gemm_bf16, dot_bf16, f32_tiles };
const char *library_name(Library l);
struct LibraryCall {
  Library library;
  int m, n, k;
  bool trans_a, trans_b;
  long calls;
};
bool library_calls_recorded();  // REMAT_PROFILE is set
void note_library_call(Library l, int m, int n, int k, bool trans_a, bool trans_b);
// The calls tallied so far (at most library_call_kinds different ones; `dropped` counts the others).
inline constexpr int library_call_kinds = 512;
std::vector<LibraryCall> library_calls(long *dropped = nullptr);

}  // namespace remat
