// Extern stages of library-GEMM kernels (generators/modelc.cpp, library_gemm): Halide calls them
// with the kernel's buffers, on the kernel's device, and leaves device transitions of the inputs
// to them. CUDA buffers go to cuBLASLt on the runtime's compute stream. Host buffers go to MKL's
// sequential GEMMs (fp32; bf16 on CPUs with AMX or without bf16 arithmetic) or remat's AVX512_BF16
// kernel (bf16 elsewhere), in row bands on Halide's threads. The OpenCL test build's GEMMs
// run on the host too: inputs are brought to host memory, the product computed there and sent
// back to the device, where the kernel's next stages read it.
#include "bf16.h"
#include "cuda_device.h"
#include "dot_bf16.h"
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
#include <cstdlib>
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

// ---- host GEMMs: sequential MKL on Halide's threads ----
// The product is cut into row bands, one per Halide thread, each band a sequential GEMM: one
// thread pool in the process (a second one, MKL's OpenMP threads, spins on the same cores while
// the Halide stages around the GEMMs run).
int gemm_threads = 1;  // set by gemm_warm_up: Halide's thread count, the number of bands

// An fp32 output block [rows, cols] (row stride ld) with an fp32 bias (columns from bias) starts
// as the bias, or out + bias when accumulating; MKL then adds the product to it (beta 1).
__attribute__((target_clones("avx512f", "avx2", "default"))) void start_from_bias(float *out, std::size_t ld, int rows,
                                                                                  int cols, const float *bias,
                                                                                  bool accumulate) {
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) out[i * ld + j] = (accumulate ? out[i * ld + j] : 0.f) + bias[j];
}

// The block of out one thread computes: rows [row0, row0 + rows) by columns [col0, col0 + cols).
struct Band {
  int row0, rows, col0, cols;
};

// fp32: a band of out = op(a) op(b) (+ bias) (+ out), one cblas_sgemm.
void sgemm_band(const GemmCall &g, Band band) {
  const float *bias = g.bias ? static_cast<const float *>(g.bias) + band.col0 : nullptr;
  float *out = static_cast<float *>(g.out) + std::size_t(band.row0) * g.n + band.col0;
  if (bias) start_from_bias(out, g.n, band.rows, band.cols, bias, g.accumulate);
  const float *a = static_cast<const float *>(g.a) + (g.trans_a ? band.row0 : std::size_t(band.row0) * g.k);
  const float *b = static_cast<const float *>(g.b) + (g.trans_b ? std::size_t(band.col0) * g.k : band.col0);
  note_library_call(Library::mkl_sgemm, band.rows, band.cols, g.k, g.trans_a, g.trans_b);
  cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, band.rows,
              band.cols, g.k, 1.f, a, g.trans_a ? g.m : g.k, b, g.trans_b ? g.k : g.n, bias || g.accumulate ? 1.f : 0.f,
              out, g.n);
}

// bf16 operands go to remat's AVX512_BF16 kernel (dot_bf16.h) where the CPU has it and no AMX, else
// to MKL's cblas_gemm_bf16bf16f32 (AMX; without bf16 arithmetic MKL converts to fp32); both
// accumulate and write fp32, in panels of at most panel_rows x panel_cols x panel_depth (the dot
// kernel's packing buffers hold one): MKL's buffers for a call grow with its operands (without
// bf16 arithmetic it converts the whole of b, 64 MiB at k = n = 4096), a panel's stay the size
// the warm-up makes. k sums over panels in order. A bf16 output's panel is summed in this thread's
// workspace and rounded once. Panel boundaries depend on the shape and the band only: a
// recomputed product has the same bits. 480 columns are ten of the dot kernel's 8 x 48 tiles (512
// left 32 columns of every panel to its slower 16 x 16 tiles); 512 rows are a whole band of a
// block's 1024-row products on two threads, so the dot kernel packs each panel of b once a band
// (256 packed it twice: 7.6% of SmolLM2's bf16 step was packing, 5.2% after this and a in place).
constexpr int panel_rows = 512, panel_cols = 480, panel_depth = 512;
static_assert(panel_rows <= dot_bf16_max_m && panel_cols <= dot_bf16_max_n && panel_depth <= dot_bf16_max_k);
std::vector<float> &bf16_out_workspace() {
  thread_local std::vector<float> workspace(std::size_t(panel_rows) * panel_cols);
  return workspace;
}

// A bf16 output row: out = (out +) (product + bias), rounded once. Compiled for AVX-512 and AVX2
// too, picked by the running CPU (the same operations per element in every clone: the same bits).
__attribute__((target_clones("avx512bw", "avx2", "default"))) void round_row(std::uint16_t *out, const float *product,
                                                                             const std::uint16_t *bias, bool accumulate,
                                                                             int cols) {
  for (int col = 0; col < cols; ++col) {
    float v = product[col];
    if (bias) v = v + bf16_to_float(bias[col]);
    if (accumulate) v = bf16_to_float(out[col]) + v;
    out[col] = float_to_bf16(v);
  }
}

void bf16_gemm_band(const GemmCall &g, Band band) {
  const auto *a = static_cast<const std::uint16_t *>(g.a), *b = static_cast<const std::uint16_t *>(g.b);
  const int lda = g.trans_a ? g.m : g.k, ldb = g.trans_b ? g.k : g.n;
  float *workspace = bf16_out_workspace().data();
  for (int i = band.row0; i < band.row0 + band.rows; i += panel_rows)
    for (int j = band.col0; j < band.col0 + band.cols; j += panel_cols) {
      const int rows = std::min(panel_rows, band.row0 + band.rows - i),
                cols = std::min(panel_cols, band.col0 + band.cols - j);
      float *c = g.bf16_out ? workspace : static_cast<float *>(g.out) + std::size_t(i) * g.n + j;
      const int ldc = g.bf16_out ? cols : g.n;
      if (!g.bf16_out && g.bias)
        start_from_bias(c, ldc, rows, cols, static_cast<const float *>(g.bias) + j, g.accumulate);
      const float beta = !g.bf16_out && (g.bias || g.accumulate) ? 1.f : 0.f;  // fp32 out: MKL adds to it
      for (int p = 0; p < g.k; p += panel_depth) {
        const std::uint16_t *ap = g.trans_a ? a + std::size_t(p) * lda + i : a + std::size_t(i) * lda + p;
        const std::uint16_t *bp = g.trans_b ? b + std::size_t(j) * ldb + p : b + std::size_t(p) * ldb + j;
        note_library_call(dot_bf16_available() ? Library::dot_bf16 : Library::mkl_gemm_bf16, rows, cols,
                          std::min(panel_depth, g.k - p), g.trans_a, g.trans_b);
        if (dot_bf16_available())
          dot_bf16_gemm(g.trans_a, g.trans_b, rows, cols, std::min(panel_depth, g.k - p), ap, lda, bp, ldb,
                        p || beta != 0.f, c, ldc);
        else
          cblas_gemm_bf16bf16f32(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                                 g.trans_b ? CblasTrans : CblasNoTrans, rows, cols, std::min(panel_depth, g.k - p), 1.f,
                                 reinterpret_cast<const MKL_BF16 *>(ap), lda, reinterpret_cast<const MKL_BF16 *>(bp),
                                 ldb, p ? 1.f : beta, c, ldc);
      }
      if (!g.bf16_out) continue;
      const auto *bias = static_cast<const std::uint16_t *>(g.bias);
      for (int r = 0; r < rows; ++r)
        round_row(static_cast<std::uint16_t *>(g.out) + std::size_t(i + r) * g.n + j, c + std::size_t(r) * ldc,
                  bias ? bias + j : nullptr, g.accumulate, cols);
    }
}

void gemm_band(const GemmCall &g, Band band) {
  if (g.bf16_in) return bf16_gemm_band(g, band);
  sgemm_band(g, band);
}

// A thread a band: bands of rows, or of columns where the product is at least 8 times wider than
// tall (an LM head's logits chunk: 256 x 50257), so that each thread packs only its own columns of
// b, once for all of a's rows, instead of all of b for half of them (GPT-2's head forward: about
// 7% faster). Column bands for every wider-than-tall product (n > m) were not faster at the block
// shapes within the machine's noise. Band boundaries depend on the shape and the thread count
// only, so a recomputed product is cut (and summed) as the first one was: the same bits. Bands
// are multiples of 16 rows or columns.
struct Bands {
  const GemmCall *g;
  bool columns;
  int count, size;  // bands, rows or columns a band (the last may have fewer)
  Band at(int band) const {
    const int first = band * size, length = std::min(size, (columns ? g->n : g->m) - first);
    return columns ? Band{0, g->m, first, length} : Band{first, length, 0, g->n};
  }
};
Bands bands_of(const GemmCall &g) {
  const bool columns = g.n >= 8 * g.m;
  const int extent = columns ? g.n : g.m,
            size = std::min(extent, ((extent + gemm_threads - 1) / gemm_threads + 15) / 16 * 16);
  return {&g, columns, (extent + size - 1) / size, size};
}
int run_band(void *, int band, uint8_t *closure) {
  const Bands &b = *reinterpret_cast<const Bands *>(closure);
  gemm_band(*b.g, b.at(band));
  return 0;
}

}  // namespace

// ---- which library kernels ran (REMAT_PROFILE) ----
namespace {
struct CallTable {
  std::atomic_flag busy = ATOMIC_FLAG_INIT;
  LibraryCall entries[library_call_kinds];
  int used = 0;
  long dropped = 0;
} call_table;
struct TableLock {
  TableLock() {
    while (call_table.busy.test_and_set(std::memory_order_acquire)) std::this_thread::yield();
  }
  ~TableLock() { call_table.busy.clear(std::memory_order_release); }
};
}  // namespace

const char *library_name(Library l) {
  switch (l) {
  case Library::mkl_sgemm: return "MKL cblas_sgemm";
  case Library::mkl_gemm_bf16: return "MKL cblas_gemm_bf16bf16f32";
  case Library::dot_bf16: return "remat dot_bf16 (AVX512_BF16)";
  case Library::f32_tiles: return "remat gemm_f32_tiles (AVX-512)";
  }
  return "?";
}
bool library_calls_recorded() {
  static const bool on = std::getenv("REMAT_PROFILE") != nullptr;
  return on;
}
void note_library_call(Library l, int m, int n, int k, bool trans_a, bool trans_b) {
  if (!library_calls_recorded()) return;
  TableLock lock;
  for (int i = 0; i < call_table.used; ++i) {
    LibraryCall &e = call_table.entries[i];
    if (e.library == l && e.m == m && e.n == n && e.k == k && e.trans_a == trans_a && e.trans_b == trans_b) {
      ++e.calls;
      return;
    }
  }
  if (call_table.used == library_call_kinds) {
    ++call_table.dropped;
    return;
  }
  call_table.entries[call_table.used++] = {l, m, n, k, trans_a, trans_b, 1};
}
std::vector<LibraryCall> library_calls(long *dropped) {
  TableLock lock;
  if (dropped) *dropped = call_table.dropped;
  return {call_table.entries, call_table.entries + call_table.used};
}

void host_gemm(const GemmCall &g) {
  if (g.m <= 0) return;
  if (g.bf16_out && !g.bf16_in) throw std::runtime_error("fp32 operands with a bf16 output: no such GEMM in any plan");
  Bands b = bands_of(g);
  if (b.count == 1) return gemm_band(g, b.at(0));
  halide_do_par_for(nullptr, run_band, 0, b.count, reinterpret_cast<uint8_t *>(&b));
}

int gemm_thread_count() { return gemm_threads; }

const char *bf16_gemm_kernel() {
  return dot_bf16_available() ? "AVX512_BF16 dot product (dot_bf16.cpp)" : "MKL gemm_bf16bf16f32";
}

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

// MKL runs once per transpose case and operand type on every Halide thread, at a shape that
// makes it take the largest buffer it keeps per thread, so that the buffer exists before the
// first step (it is then reused: a step allocates nothing). That buffer grows with m, n and k up to
// a cap that depends on the CPU (MKL 2026.2, sequential sgemm, measured with a process forked after
// the warm-up for each shape, m 16-25136, n 64-50257, k 64-50257, every transpose case): on AMD Zen 4
// 5522064 bytes, which 512 x 8192 x 512 reaches; on an Intel Xeon with AVX-512 and AMX MKL's
// `fullacopybcopy` path takes up to 20130320 bytes, which needs k >= 768 and n >= 12288 (an LM head's
// column band, 256 x 25136 x 768, took 19933712 bytes after a 512 x 8192 x 512 warm-up: GPT-2's
// two allocations in a step there). 512 x 16384 x 1024 reaches both caps (on the Xeon none of the
// 860 shapes that allocated after 512 x 8192 x 512 does after it). The bf16 GEMMs (bf16 and fp32 outputs) run at the
// same shape, in full panels (bf16_gemm_band): MKL's buffers for a panel and each thread's bf16-output workspace; where
// the bf16 panels run on the dot product instead (dot_bf16.cpp), a small product makes its packing buffers and the
// workspace, which have their full size from the first use. The threads meet first, so that no thread runs two
// warm-ups. test_gemm_heap runs the examples' full-size products after it with the heap counted.
namespace {
struct WarmUp {
  static constexpr int m = 512, n = 16384, k = 1024;
  std::atomic<int> arrived{0};
  std::vector<float> a, b;
  std::vector<std::uint16_t> a16, b16;
};
int warm_up_thread(void *, int, uint8_t *closure) {
  WarmUp &w = *reinterpret_cast<WarmUp *>(closure);
  w.arrived.fetch_add(1);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);  // a pool smaller than asked
  while (w.arrived.load() < gemm_threads && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  std::vector<float> out(std::size_t(WarmUp::m) * WarmUp::n);
  for (int t = 0; t < 12; ++t) {  // transposes (t % 4) x {fp32, bf16 -> fp32, bf16 -> bf16}
    GemmCall g;
    g.bf16_in = t >= 4, g.bf16_out = t >= 8;
    g.a = g.bf16_in ? static_cast<const void *>(w.a16.data()) : w.a.data();
    g.b = g.bf16_in ? static_cast<const void *>(w.b16.data()) : w.b.data();
    g.out = out.data(), g.m = WarmUp::m, g.n = WarmUp::n, g.k = WarmUp::k;
    if (g.bf16_in && dot_bf16_available()) g.m = g.n = g.k = 16;  // no MKL: buffers made whole on first use
    g.trans_a = t & 1, g.trans_b = t & 2;
    gemm_band(g, {0, g.m, 0, g.n});
  }
  return 0;
}
}  // namespace

void gemm_warm_up() {
  static const bool done = [] {
    int threads = halide_set_num_threads(0);                // 0: Halide's default; the old value comes back
    if (threads <= 0) threads = halide_set_num_threads(0);  // no pool yet: the default is the count
    halide_set_num_threads(threads);
    gemm_threads = std::max(1, threads);
    WarmUp w;
    w.a.assign(std::size_t(WarmUp::m) * WarmUp::k, 1.f);
    w.b.assign(std::size_t(WarmUp::k) * WarmUp::n, 1.f);
    w.a16.assign(w.a.size(), float_to_bf16(1.f));
    w.b16.assign(w.b.size(), float_to_bf16(1.f));
    halide_do_par_for(nullptr, warm_up_thread, 0, gemm_threads, reinterpret_cast<uint8_t *>(&w));
    TableLock lock;  // the warm-up's own calls are not the run's
    call_table.used = 0;
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
