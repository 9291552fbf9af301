// No heap in a step, at full size, on this CPU: after gemm_warm_up (what every executor runs first),
// every host product of GPT-2 124M's and SmolLM2-135M's steps (their model values, batch 1 x 1024)
// allocates nothing. MKL keeps a buffer per thread whose size depends on the shape and on the CPU
// (on an Intel Xeon an LM head's column band once took 19.9 MB in the first step, after a warm-up
// that sufficed on AMD Zen 4): the ctest models are too small to reach those shapes, so this test
// runs them directly, through host_gemm as the kernels' GEMM stages do (the same bands and panels
// on Halide's threads). Shapes per linear layer (rows, in, out; the fused head's rows are its
// chunk's): the forward [rows, out] over in, the input gradient [rows, in] over out, the weight
// gradient [in, out] or [out, in] over rows (a tied head's is the token table's), each in all four
// transpose cases and as fp32, bf16 -> fp32 and bf16 -> bf16 products (a superset of what the
// model compiler emits). With REMAT_PROFILE=1 the library kernels that ran are listed at the end.
#include <boost/test/unit_test.hpp>

#include <HalideRuntime.h>

#include "bf16.h"
#include "gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <tuple>
#include <vector>
import remat;
import remat.runtime;
import gpt2;
import smollm2;

using namespace remat;

namespace {

using Shape = std::tuple<int, int, int>;  // m, n, k

// The products of a model's steps at batch 1 (bf16 and fp32 plans chunk the head alike when the
// chunk is whole samples or 256 rows: both precisions' chunks are taken).
std::set<Shape> step_products(const Model &m) {
  std::set<Shape> shapes;
  for (int s = 0; s < m.n_stages; ++s) {
    const Block &b = m.stages[s];
    std::vector<long long> rows{m.rows_per_sample()};
    if (s == head_stage(m)) {
      rows.clear();
      for (Precision p : {Precision::fp32, Precision::bf16})
        for (const RowRange &r : head_chunks(m, 1, p)) rows.push_back(r.rows);
    }
    for (int k = 0; k < b.n_layers; ++k) {
      const Layer &l = b.layers[k];
      if (l.op != Op::linear) continue;
      for (long long r64 : rows) {
        const int r = int(r64);
        shapes.insert({r, l.out, l.in});
        shapes.insert({r, l.in, l.out});
        shapes.insert({l.in, l.out, r});
        shapes.insert({l.out, l.in, r});
      }
    }
  }
  return shapes;
}

void runs_without_heap(const char *model, const std::set<Shape> &shapes) {
  gemm_warm_up();
  std::size_t most_a = 0, most_b = 0, most_out = 0;
  for (auto [m, n, k] : shapes) {
    most_a = std::max(most_a, std::size_t(m) * k);
    most_b = std::max(most_b, std::size_t(k) * n);
    most_out = std::max(most_out, std::size_t(m) * n);
  }
  std::vector<float> a(most_a, 0.5f), b(most_b, 0.25f), out(most_out);
  std::vector<std::uint16_t> a16(most_a, float_to_bf16(0.5f)), b16(most_b, float_to_bf16(0.25f));
  int calls = 0;
  for (auto [m, n, k] : shapes)
    for (int types = 0; types < 3; ++types)  // fp32, bf16 -> fp32, bf16 -> bf16
      for (int t = 0; t < 4; ++t) {
        GemmCall g;
        g.m = m, g.n = n, g.k = k, g.trans_a = t & 1, g.trans_b = t & 2;
        g.bf16_in = types > 0, g.bf16_out = types == 2;
        g.a = g.bf16_in ? static_cast<const void *>(a16.data()) : a.data();
        g.b = g.bf16_in ? static_cast<const void *>(b16.data()) : b.data();
        g.out = out.data();
        runtime::reset_step_heap();
        {
          runtime::CountedHeap counted;
          host_gemm(g);
        }
        const runtime::StepHeap heap = runtime::step_heap();
        BOOST_TEST_INFO(model << ": " << describe(g));
        BOOST_TEST(heap.allocations == 0u, heap.allocations << " allocations, " << heap.bytes << " bytes");
        ++calls;
      }
  std::printf("%s: %zu product shapes, %d host GEMMs after the warm-up on %d threads\n", model, shapes.size(), calls,
              gemm_thread_count());
}

}  // namespace

BOOST_AUTO_TEST_CASE(gpt2_124m_products_allocate_nothing) {
  runs_without_heap("GPT-2 124M", step_products(gpt2::model));
}

BOOST_AUTO_TEST_CASE(smollm2_135m_products_allocate_nothing) {
  runs_without_heap("SmolLM2-135M", step_products(smollm2::model));
}

BOOST_AUTO_TEST_CASE(the_shapes_are_the_full_size_ones) {
  // the head's forward over a chunk of GPT-2's logits: 256 rows x 50257 classes over 768 features
  BOOST_TEST(step_products(gpt2::model).count({256, 50257, 768}) == 1u);
  BOOST_TEST(step_products(smollm2::model).count({1024, 2 * 1536, 576}) == 1u);  // SwiGLU's gate and up
}

// With REMAT_PROFILE=1 (its own ctest entry) the table of library calls names the kernel and the
// band each thread ran: one product in fp32 and one in bf16, 1024 rows in bands of 1024 / threads.
BOOST_AUTO_TEST_CASE(the_profile_names_the_library_kernels,
                     *boost::unit_test::precondition([](boost::unit_test::test_unit_id) {
                       return boost::test_tools::assertion_result(library_calls_recorded());
                     })) {
  gemm_warm_up();
  std::vector<float> a(1024 * 64, 1.f), b(64 * 96, 1.f), out(1024 * 96);
  std::vector<std::uint16_t> a16(a.size(), float_to_bf16(1.f)), b16(b.size(), float_to_bf16(1.f));
  GemmCall g;
  g.m = 1024, g.n = 96, g.k = 64, g.a = a.data(), g.b = b.data(), g.out = out.data();
  host_gemm(g);
  g.bf16_in = true, g.a = a16.data(), g.b = b16.data();
  host_gemm(g);
  const int band = ((1024 + gemm_thread_count() - 1) / gemm_thread_count() + 15) / 16 * 16;
  const Library bf16 = std::string(bf16_gemm_kernel()).starts_with("MKL") ? Library::mkl_gemm_bf16 : Library::dot_bf16;
  for (Library l : {Library::mkl_sgemm, bf16}) {
    long calls = 0;
    for (const LibraryCall &c : library_calls())
      if (c.library == l && c.n == 96 && c.k == 64 && !c.trans_a && !c.trans_b && c.m == std::min(band, 1024))
        calls += c.calls;
    BOOST_TEST_INFO(library_name(l));
    BOOST_TEST(calls == (1024 + band - 1) / band);
  }
}
