// Extern stages of library-GEMM kernels (generators/modelc.cpp, library_gemm): Halide calls them
// with the kernel's buffers, on the kernel's device, and leaves device transitions of the inputs
// to them. CUDA buffers go to cuBLASLt on the runtime's compute stream. Host buffers go to MKL's
// sequential sgemm, in row bands on Halide's threads. The OpenCL test build's GEMMs run on the
// host too: inputs are brought to host memory, the product computed there (bf16 operands by a
// plain loop) and sent back to the device, where the kernel's next stages read it.
#include "bf16.h"
#include "cuda_device.h"
#include "gemm.h"

#include <HalideRuntime.h>
#include <HalideRuntimeCuda.h>
#include <HalideRuntimeOpenCL.h>
#include <fmt/format.h>
#include <mkl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

extern "C" char remat_halide_error[1024];
// Present when the kernels' Halide runtime includes CUDA (REMAT_CUDA_CAPABILITY != 0) / OpenCL.
#pragma weak halide_cuda_device_interface
#pragma weak halide_opencl_device_interface

namespace remat {

std::string describe(const GemmCall &g) {
  const char *in = g.bf16_in ? "bf16" : "fp32";
  return fmt::format("m={} n={} k={}, a {} {} ld {}, b {} {} ld {}, out {} ld {}, epilogue {}, beta {}", g.m, g.n, g.k,
                     in, g.trans_a ? "[k, m] (trans_a)" : "[m, k]", g.trans_a ? g.m : g.k, in,
                     g.trans_b ? "[n, k] (trans_b)" : "[k, n]", g.trans_b ? g.k : g.n, g.bf16_out ? "bf16" : "fp32",
                     g.n, g.bias ? "bias" : "none", g.accumulate ? 1 : 0);
}

std::size_t address_alignment(const void *p) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  std::size_t a = 1;
  while (a < 256 && at % (2 * a) == 0) a *= 2;
  return a;
}

void require_gemm_alignment(const GemmCall &g) {
  const std::pair<const char *, const void *> operands[] = {{"a", g.a}, {"b", g.b}, {"out", g.out}, {"bias", g.bias}};
  for (auto [name, p] : operands)
    if (p && address_alignment(p) < gemm_alignment)
      throw std::runtime_error(
          fmt::format("GEMM operand {} at {} is only {}-byte aligned; cuBLASLt is asked for {}-byte "
                      "aligned operands (the planner aligns every arena tensor to 64 bytes)",
                      name, p, address_alignment(p), gemm_alignment));
}

namespace {

float load(const void *p, std::size_t i, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<const std::uint16_t *>(p)[i]) : static_cast<const float *>(p)[i];
}

// The sums run over k in order for each output, as a dot product would.
void plain_gemm(const GemmCall &g) {
  std::vector<float> row(g.n);
  for (int i = 0; i < g.m; ++i) {
    std::fill(row.begin(), row.end(), 0.f);
    for (int p = 0; p < g.k; ++p) {
      const float a = load(g.a, g.trans_a ? std::size_t(p) * g.m + i : std::size_t(i) * g.k + p, g.bf16_in);
      for (int j = 0; j < g.n; ++j)
        row[j] += a * load(g.b, g.trans_b ? std::size_t(j) * g.k + p : std::size_t(p) * g.n + j, g.bf16_in);
    }
    for (int j = 0; j < g.n; ++j) {
      const std::size_t at = std::size_t(i) * g.n + j;
      float v = row[j];
      if (g.bias) v = v + load(g.bias, j, g.bf16_out);
      if (g.accumulate) v = load(g.out, at, g.bf16_out) + v;
      if (g.bf16_out)
        static_cast<std::uint16_t *>(g.out)[at] = float_to_bf16(v);
      else
        static_cast<float *>(g.out)[at] = v;
    }
  }
}

// ---- host GEMMs: sequential MKL on Halide's threads ----
// The product is cut into row bands, one per Halide thread, each band a sequential sgemm: one
// thread pool in the process (a second one, MKL's OpenMP threads, spins on the same cores while
// the Halide stages around the GEMMs run).
int gemm_threads = 1;  // set by gemm_warm_up: Halide's thread count, the number of bands

// Rows [first, first + count) of out = op(a) op(b) (+ bias) (+ out): out starts as the bias (or
// out + bias) and MKL adds the product to it.
void gemm_band(const GemmCall &g, int first, int count) {
  const float *a = static_cast<const float *>(g.a), *b = static_cast<const float *>(g.b);
  const float *bias = static_cast<const float *>(g.bias);
  float *out = static_cast<float *>(g.out) + std::size_t(first) * g.n;
  if (bias)
    for (int i = 0; i < count; ++i)
      for (int j = 0; j < g.n; ++j)
        out[std::size_t(i) * g.n + j] = (g.accumulate ? out[std::size_t(i) * g.n + j] : 0.f) + bias[j];
  a += g.trans_a ? first : std::size_t(first) * g.k;  // the band's rows of op(a)
  cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, count, g.n,
              g.k, 1.f, a, g.trans_a ? g.m : g.k, b, g.trans_b ? g.k : g.n, bias || g.accumulate ? 1.f : 0.f, out, g.n);
}

// Band boundaries depend on m and the thread count only, so a recomputed product is cut (and
// summed) as the first one was: the same bits. Bands are multiples of 16 rows.
struct Bands {
  const GemmCall *g;
  int count, rows;  // bands, rows per band (the last may be shorter)
};
Bands bands_of(const GemmCall &g) {
  const int rows = std::min(g.m, ((g.m + gemm_threads - 1) / gemm_threads + 15) / 16 * 16);
  return {&g, (g.m + rows - 1) / rows, rows};
}
int run_band(void *, int band, uint8_t *closure) {
  const Bands &b = *reinterpret_cast<const Bands *>(closure);
  const int first = band * b.rows;
  gemm_band(*b.g, first, std::min(b.rows, b.g->m - first));
  return 0;
}

}  // namespace

void host_gemm(const GemmCall &g) {
  if (g.bf16_in || g.bf16_out) return plain_gemm(g);  // only the OpenCL test build: CPU bf16 kernels keep Halide GEMMs
  if (g.m <= 0) return;
  Bands b = bands_of(g);
  if (b.count == 1) return gemm_band(g, 0, g.m);
  halide_do_par_for(nullptr, run_band, 0, b.count, reinterpret_cast<uint8_t *>(&b));
}

int gemm_thread_count() { return gemm_threads; }

namespace {
bool on_cuda(const halide_buffer_t *b) {
  return b->device && &halide_cuda_device_interface && b->device_interface == halide_cuda_device_interface();
}

// A bounds query asks which part of each input the output needs: all of them (the output is
// always the whole tensor, computed at the root).
void bounds(halide_buffer_t *a, halide_buffer_t *b, halide_buffer_t *bias, int k, int flags,
            const halide_buffer_t *out) {
  const halide_dimension_t cols = out->dim[0], rows = out->dim[1];
  const halide_dimension_t inner{0, k, 0, 0};
  if (a->is_bounds_query()) {
    a->dim[0] = flags & 1 ? rows : inner;
    a->dim[1] = flags & 1 ? inner : rows;
  }
  if (b->is_bounds_query()) {
    b->dim[0] = flags & 2 ? inner : cols;
    b->dim[1] = flags & 2 ? cols : inner;
  }
  if (bias && bias->is_bounds_query()) bias->dim[0] = cols;
}

// The buffers must be whole dense tensors of the GEMM's shape (as the model compiler makes them).
void check_shapes(const halide_buffer_t *a, const halide_buffer_t *b, const halide_buffer_t *bias, int k, int flags,
                  const halide_buffer_t *out) {
  auto dense = [](const halide_buffer_t *t, int cols, int rows) {
    return t->dimensions == (rows ? 2 : 1) && t->dim[0].min == 0 && t->dim[0].extent == cols && t->dim[0].stride == 1 &&
           (!rows || (t->dim[1].min == 0 && t->dim[1].extent == rows && t->dim[1].stride == cols));
  };
  const int m = out->dim[1].extent, n = out->dim[0].extent;
  if (!dense(out, n, m) || !dense(a, flags & 1 ? m : k, flags & 1 ? k : m) ||
      !dense(b, flags & 2 ? k : n, flags & 2 ? n : k) || (bias && !dense(bias, n, 0)))
    throw std::runtime_error("operand shapes do not match the product");
  if (a->type.bits != b->type.bits || (bias && bias->type.bits != out->type.bits))
    throw std::runtime_error("operand element types do not match");
}

int run(halide_buffer_t *a, halide_buffer_t *b, halide_buffer_t *bias, int k, int flags, int accumulate,
        halide_buffer_t *out) {
  if (a->is_bounds_query() || b->is_bounds_query() || (bias && bias->is_bounds_query())) {
    bounds(a, b, bias, k, flags, out);
    return 0;
  }
  if (out->is_bounds_query()) return 0;
  GemmCall g;
  g.m = out->dim[1].extent;
  g.n = out->dim[0].extent;
  g.k = k;
  g.trans_a = flags & 1;
  g.trans_b = flags & 2;
  g.bf16_in = a->type.bits == 16;
  g.bf16_out = out->type.bits == 16;
  g.accumulate = accumulate != 0;
  try {
    check_shapes(a, b, bias, k, flags, out);
    if (on_cuda(out)) {
      for (halide_buffer_t *in : {a, b, bias, out}) {  // Halide leaves an extern stage's inputs where they are
        if (in && in->host_dirty() && halide_copy_to_device(nullptr, in, halide_cuda_device_interface()) != 0)
          throw std::runtime_error("copy to the device failed");
        if (in && !in->device) throw std::runtime_error("an operand is not in device memory");
      }
      g.a = reinterpret_cast<const void *>(a->device);
      g.b = reinterpret_cast<const void *>(b->device);
      g.bias = bias ? reinterpret_cast<const void *>(bias->device) : nullptr;
      g.out = reinterpret_cast<void *>(out->device);
      cuda::gemm(g);
    } else {
      for (halide_buffer_t *in : {a, b, bias})
        if (in && in->device_dirty() && halide_copy_to_host(nullptr, in) != 0)
          throw std::runtime_error("copy to host failed");
      if (out->device_dirty() && halide_copy_to_host(nullptr, out) != 0)
        throw std::runtime_error("copy to host failed");
      g.a = a->host;
      g.b = b->host;
      g.bias = bias ? bias->host : nullptr;
      g.out = out->host;
      host_gemm(g);
      out->set_host_dirty(true);
      if (flags & 4) {  // an OpenCL kernel: its next stages read the product on the device
        const halide_device_interface_t *device =
            out->device_interface ? out->device_interface
                                  : (&halide_opencl_device_interface ? halide_opencl_device_interface() : nullptr);
        if (!device || halide_copy_to_device(nullptr, out, device) != 0)
          throw std::runtime_error("copy to the OpenCL device failed");
      }
    }
  } catch (const std::exception &e) {
    std::snprintf(remat_halide_error, sizeof remat_halide_error, "GEMM %dx%dx%d: %s", g.m, g.n, g.k, e.what());
    return -1;
  }
  return 0;
}

}  // namespace

// MKL runs once per transpose case on every Halide thread, at a shape that makes it take the
// largest buffer it keeps per thread, so that the buffer exists before the first step (it is then
// reused: a step allocates nothing). That buffer grows with m, n and k up to 5522064 bytes (MKL
// 2026.2, sequential sgemm), which 512 x 8192 x 512 reaches: a GEMM as wide as a 4096-token LM
// head (n = 4096) grows it past what 2048 x 2048 x 512 takes, and none grows it past the cap
// (m 64 and 2048, n up to 16384, k up to 2048, every transpose case: no allocation after this).
// The threads meet first, so that no thread runs two of the warm-ups.
namespace {
struct WarmUp {
  static constexpr int m = 512, n = 8192, k = 512;
  std::atomic<int> arrived{0};
  std::vector<float> a, b;
};
int warm_up_thread(void *, int, uint8_t *closure) {
  WarmUp &w = *reinterpret_cast<WarmUp *>(closure);
  w.arrived.fetch_add(1);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);  // a pool smaller than asked
  while (w.arrived.load() < gemm_threads && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  std::vector<float> out(std::size_t(WarmUp::m) * WarmUp::n);
  for (int t = 0; t < 4; ++t) {
    GemmCall g;
    g.a = w.a.data(), g.b = w.b.data(), g.out = out.data(), g.m = WarmUp::m, g.n = WarmUp::n, g.k = WarmUp::k;
    g.trans_a = t & 1, g.trans_b = t & 2;
    gemm_band(g, 0, g.m);
  }
  return 0;
}
}  // namespace

void gemm_warm_up() {
  static const bool done = [] {
    const int threads = halide_set_num_threads(0);  // 0: Halide's default; the old value comes back
    halide_set_num_threads(threads);
    gemm_threads = std::max(1, threads);
    WarmUp w;
    w.a.assign(std::size_t(WarmUp::m) * WarmUp::k, 1.f);
    w.b.assign(std::size_t(WarmUp::k) * WarmUp::n, 1.f);
    halide_do_par_for(nullptr, warm_up_thread, 0, gemm_threads, reinterpret_cast<uint8_t *>(&w));
    return true;
  }();
  (void)done;
}

}  // namespace remat

extern "C" int remat_gemm(halide_buffer_t *a, halide_buffer_t *b, int32_t k, int32_t flags, int32_t accumulate,
                          halide_buffer_t *out) {
  return remat::run(a, b, nullptr, k, flags, accumulate, out);
}

extern "C" int remat_gemm_bias(halide_buffer_t *a, halide_buffer_t *b, halide_buffer_t *bias, int32_t k, int32_t flags,
                               int32_t accumulate, halide_buffer_t *out) {
  return remat::run(a, b, bias, k, flags, accumulate, out);
}
