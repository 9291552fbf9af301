// The CPU GEMM schedule of the generated kernels (generators/schedules.h, JIT-compiled for the
// same pinned target) against OpenBLAS's sgemm, at the shapes the example models run, in one
// run: the figure that decides whether the Halide GEMM stays (see the design notes).
#include <Halide.h>
#include <cblas.h>
#include <fmt/format.h>
#include <layers.h>
#include <schedules.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

struct Shape {
  const char *where;
  int rows, inner, cols;  // out[rows, cols] = a[rows, inner] * w[inner, cols]
};

template <class F> double median_ms(F run, int reps) {
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

}  // namespace

int main(int argc, char **argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  if (reps < 1) {
    std::fprintf(stderr, "usage: bench-gemm [REPETITIONS >= 1]\n");
    return 2;
  }
  const Halide::Target target(REMAT_CPU_TARGET);
  const std::vector<Shape> shapes = {
      {"MLP stem", 256, 784, 256},      {"MLP block fc1", 256, 256, 512}, {"MLP block fc2", 256, 512, 256},
      {"GPT q/k/v", 2048, 128, 384},    {"GPT MLP fc", 2048, 128, 512},   {"GPT MLP proj", 2048, 512, 128},
  };
  fmt::print("sgemm out[rows, cols] = a[rows, inner] w[inner, cols]; median of {} runs; Halide target {}; {} OpenBLAS threads\n",
             reps, REMAT_CPU_TARGET, openblas_get_num_threads());
  const Halide::Target host = Halide::get_host_target();
  fmt::print("(halide-host: the same schedule for this machine's own features, {})\n", host.to_string());
  fmt::print("{:<15} {:>6} {:>6} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>13} {:>13}\n", "shape", "rows", "inner",
             "cols", "halide ms", "host ms", "blas ms", "halide GF/s", "blas GF/s", "halide/blas", "host/blas");
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const Shape &s : shapes) {
    Halide::Buffer<float> a(s.inner, s.rows), w(s.cols, s.inner), out(s.cols, s.rows);
    a.for_each_value([&](float &x) { x = u(rng); });
    w.for_each_value([&](float &x) { x = u(rng); });
    auto halide_ms = [&](const Halide::Target &t) {
      remat::gen::Vars v;
      remat::gen::Layers L(Halide::Float(32), v);
      remat::gen::Scheduler sched(t, v);
      Halide::Func fa(a), fw(w);
      remat::gen::MatMul m = L.matmul("out", fa, fw, s.inner);
      sched.matmul(m, -1, s.cols);
      Halide::Pipeline p(m.out);
      p.compile_jit(t);
      return median_ms([&] { p.realize(out); }, reps);
    };
    const double halide_host = halide_ms(host);
    const double halide = halide_ms(target);  // leaves `out` from the pinned target for the check
    std::vector<float> c(std::size_t(s.rows) * s.cols);
    const double blas = median_ms(
        [&] {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.rows, s.cols, s.inner, 1.f, a.data(), s.inner,
                      w.data(), s.cols, 0.f, c.data(), s.cols);
        },
        reps);
    // the two must agree before their speeds mean anything
    double worst = 0;
    for (int r = 0; r < s.rows; ++r)
      for (int j = 0; j < s.cols; ++j) worst = std::max(worst, double(std::abs(out(j, r) - c[std::size_t(r) * s.cols + j])));
    if (worst > 1e-3) {
      std::fprintf(stderr, "bench-gemm: %s: results differ by %g\n", s.where, worst);
      return 1;
    }
    const double gflop = 2.0 * s.rows * s.inner * s.cols / 1e9;
    fmt::print("{:<15} {:>6} {:>6} {:>6} {:>11.3f} {:>11.3f} {:>11.3f} {:>11.1f} {:>11.1f} {:>13.2f} {:>13.2f}\n",
               s.where, s.rows, s.inner, s.cols, halide, halide_host, blas, gflop / (halide / 1e3),
               gflop / (blas / 1e3), halide / blas, halide_host / blas);
  }
  return 0;
}
