// remat's CPU GEMM (runtime/gemm.cpp's host_gemm: sequential MKL in row bands on Halide's threads, what the
// library-GEMM kernels call) at every GEMM shape the example models run, forward and backward: with fp32 operands
// (sgemm) and with bf16 operands, fp32 out (remat::bf16_gemm_kernel(): remat's AVX512_BF16 kernel or MKL's
// cblas_gemm_bf16bf16f32; the bf16 operands are the fp32 ones rounded to
// nearest even), each product checked against a double-precision one. `--json` prints the rows as JSON for
// bench/gemm.py, which puts torch.matmul (fp32 and bf16) beside them.
#include <HalideBuffer.h>
#include <HalideRuntime.h>
#include <bf16.h>
#include <fmt/format.h>
#include <gemm.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

struct Shape {
  std::string where;
  int m, n, k;  // out[m, n] = op(a) op(b), over k
  bool trans_a, trans_b;
};

// Each linear (rows, in -> out) runs three GEMMs: y = x w, dx = dy w^T and dW = x^T dy.
void add_linear(std::vector<Shape> &to, const std::string &where, int rows, int in, int out) {
  to.push_back({where + " forward", rows, out, in, false, false});
  to.push_back({where + " dx", rows, in, out, false, true});
  to.push_back({where + " dW", in, out, rows, true, false});
}

template <class F>
double median_ms(F run, int reps) {
  std::vector<double> ms;
  run();  // warm-up
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::ranges::sort(ms);
  return ms[ms.size() / 2];
}

// The largest |reference - out| over a grid of out's entries, the reference summed in double from the operands as
// floats (a_at(x, y) and b_at(x, y) read an element of a and b, x the column, as float).
template <class A, class B>
double worst_error(const Shape &s, A a_at, B b_at, const Halide::Runtime::Buffer<float> &out) {
  double worst = 0;
  for (int i = 0; i < s.m; i += 7)
    for (int j = 0; j < s.n; j += 5) {
      double sum = 0;
      for (int p = 0; p < s.k; ++p)
        sum += double(s.trans_a ? a_at(i, p) : a_at(p, i)) * double(s.trans_b ? b_at(p, j) : b_at(j, p));
      worst = std::max(worst, std::abs(sum - out(j, i)));
    }
  return worst;
}

}  // namespace

int main(int argc, char **argv) {
  int reps = 20;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json"))
      json = true;
    else if ((reps = std::atoi(argv[i])) < 1) {
      std::fprintf(stderr, "usage: bench-gemm [REPETITIONS >= 1] [--json]\n");
      return 2;
    }
  }
  halide_do_par_for(nullptr, [](void *, int, std::uint8_t *) { return 0; }, 0, 256, nullptr);
  remat::gemm_warm_up();
  std::vector<Shape> shapes;
  for (auto [name, in, out] :
       {std::tuple{"MLP stem", 784, 256}, {"MLP fc1", 256, 512}, {"MLP fc2", 512, 256}, {"MLP head", 256, 10}})
    add_linear(shapes, name, 256, in, out);
  for (auto [name, in, out] : {std::tuple{"GPT qkv", 128, 384},
                               {"GPT attn proj", 128, 128},
                               {"GPT fc", 128, 512},
                               {"GPT fc proj", 512, 128},
                               {"GPT head", 128, 128}})
    add_linear(shapes, name, 2048, in, out);
  for (auto [name, in, out] : {std::tuple{"GPT-2 qkv", 768, 2304},
                               {"GPT-2 attn proj", 768, 768},
                               {"GPT-2 fc", 768, 3072},
                               {"GPT-2 fc proj", 3072, 768},
                               {"SmolLM2 gate_up", 576, 3072},
                               {"SmolLM2 down", 1536, 576}})
    add_linear(shapes, name, 1024, in, out);

  if (!json)
    fmt::print(
        "out[m, n] = op(a) op(b) over k, fp32 out; remat with fp32 and with bf16 operands (bf16: {}); median of {} "
        "runs, {} threads\n{:<20} {:>5} {:>5} {:>5} {:>9} {:>9} {:>11} {:>11}\n",
        remat::bf16_gemm_kernel(), reps, remat::gemm_thread_count(), "shape", "m", "n", "k", "remat ms", "bf16 ms",
        "remat GF/s", "bf16 GF/s");
  nlohmann::json rows = nlohmann::json::array();
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const Shape &s : shapes) {
    // a[m, k] (or [k, m]), b[k, n] (or [n, k]), 64-byte aligned as arena tensors are
    Halide::Runtime::Buffer<float> a(s.trans_a ? s.m : s.k, s.trans_a ? s.k : s.m),
        b(s.trans_b ? s.k : s.n, s.trans_b ? s.n : s.k), out(s.n, s.m), check(s.n, s.m);
    a.for_each_value([&](float &x) { x = u(rng); });
    b.for_each_value([&](float &x) { x = u(rng); });
    remat::GemmCall g;
    g.a = a.data(), g.b = b.data(), g.out = out.data(), g.m = s.m, g.n = s.n, g.k = s.k;
    g.trans_a = s.trans_a, g.trans_b = s.trans_b;
    const double remat_ms = median_ms([&] { remat::host_gemm(g); }, reps);
    // the product must be right before its speed means anything
    if (const double worst = worst_error(
            s, [&](int x, int y) { return a(x, y); }, [&](int x, int y) { return b(x, y); }, out);
        worst > 1e-3 * s.k) {
      std::fprintf(stderr, "bench-gemm: %s: the fp32 product is off by %g\n", s.where.c_str(), worst);
      return 1;
    }
    // the same GEMM on bf16 operands (a and b rounded to nearest even), fp32 out: checked against the product of
    // the rounded operands, so the products' fp32 accumulation is all the tolerance covers, as for fp32
    Halide::Runtime::Buffer<std::uint16_t> a16(a.width(), a.height()), b16(b.width(), b.height());
    a16.for_each_element([&](int x, int y) { a16(x, y) = remat::float_to_bf16(a(x, y)); });
    b16.for_each_element([&](int x, int y) { b16(x, y) = remat::float_to_bf16(b(x, y)); });
    out.fill(0.f);
    remat::GemmCall g16 = g;
    g16.a = a16.data(), g16.b = b16.data(), g16.bf16_in = true;
    const double bf16_ms = median_ms([&] { remat::host_gemm(g16); }, reps);
    if (const double worst = worst_error(
            s, [&](int x, int y) { return remat::bf16_to_float(a16(x, y)); },
            [&](int x, int y) { return remat::bf16_to_float(b16(x, y)); }, out);
        worst > 1e-3 * s.k) {
      std::fprintf(stderr, "bench-gemm: %s: the bf16 product is off by %g\n", s.where.c_str(), worst);
      return 1;
    }
    const double gflop = 2.0 * s.m * s.n * s.k / 1e9;
    rows.push_back({{"shape", s.where},
                    {"m", s.m},
                    {"n", s.n},
                    {"k", s.k},
                    {"trans_a", s.trans_a},
                    {"trans_b", s.trans_b},
                    {"remat_ms", remat_ms},
                    {"remat_gflops", gflop / (remat_ms / 1e3)},
                    {"remat_bf16_ms", bf16_ms},
                    {"remat_bf16_gflops", gflop / (bf16_ms / 1e3)}});
    if (!json)
      fmt::print("{:<20} {:>5} {:>5} {:>5} {:>9.3f} {:>9.3f} {:>11.1f} {:>11.1f}\n", s.where, s.m, s.n, s.k, remat_ms,
                 bf16_ms, gflop / (remat_ms / 1e3), gflop / (bf16_ms / 1e3));
  }
  if (json)
    fmt::print("{}\n", nlohmann::json{{"threads", remat::gemm_thread_count()},
                                      {"bf16_kernel", remat::bf16_gemm_kernel()},
                                      {"shapes", rows}}
                           .dump());
  return 0;
}
