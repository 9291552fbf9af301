// REMAT_PROFILE: per kernel, its time and rates against this machine's roofs.
module;
#include <HalideRuntime.h>
#include "gemm.h"
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>
module remat.runtime;
import remat;

namespace remat::runtime {

namespace {
// The roofs REMAT_PROFILE compares kernels with, measured here and now on all of Halide's threads:
// the host GEMM's rate at a large square fp32 shape, and copy bandwidth over 256 MiB (bytes read
// plus bytes written).
struct Roofs {
  double gemm_gflops = 0, memory_gbps = 0;
};
Roofs measure_roofs() {
  auto best_seconds = [](auto &&run) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  Roofs roofs;
  const int n = 1024;
  std::vector<float> a(std::size_t(n) * n, 1.f), b(a), c(a);
  GemmCall g;
  g.a = a.data(), g.b = b.data(), g.out = c.data(), g.m = g.n = g.k = n;
  roofs.gemm_gflops = 2.0 * n * n * n / best_seconds([&] { host_gemm(g); }) / 1e9;
  struct Copy {
    std::vector<std::byte> from, to;
    std::size_t chunk;
  } copy{std::vector<std::byte>(std::size_t(256) << 20, std::byte{1}), std::vector<std::byte>(std::size_t(256) << 20),
         1 << 20};
  auto task = [](void *, int i, std::uint8_t *closure) {
    Copy &c = *reinterpret_cast<Copy *>(closure);
    std::memcpy(c.to.data() + i * c.chunk, c.from.data() + i * c.chunk, c.chunk);
    return 0;
  };
  const int chunks = int(copy.from.size() / copy.chunk);
  roofs.memory_gbps =
      2.0 * double(copy.from.size()) /
      best_seconds([&] { halide_do_par_for(nullptr, task, 0, chunks, reinterpret_cast<std::uint8_t *>(&copy)); }) / 1e9;
  return roofs;
}
}  // namespace

// With REMAT_PROFILE set, per kernel on stderr: the time summed over its calls, and the rates it
// reached (GEMM and attention arithmetic per second, tensor bytes read and written per second)
// against this machine's GEMM rate and copy bandwidth.
void Executor::report_profile() const {
  if (!std::getenv("REMAT_PROFILE")) return;
  struct Totals {
    double seconds = 0, flops = 0, bytes = 0;
    long calls = 0;
  };
  std::map<std::string, Totals> by_kernel;
  for (auto *list : {&train_calls, &optimize_calls, &eval_calls})
    for (auto &b : *list) {
      Totals &t = by_kernel[b->kernel->name];
      t.seconds += b->seconds;
      t.calls += b->calls;
      t.flops += b->flops * double(b->calls);
      t.bytes += double(b->bytes) * double(b->calls);
    }
  long dropped = 0;
  const std::vector<LibraryCall> library = library_calls(&dropped);  // before the roofs' own GEMMs
  const Roofs roofs = measure_roofs();
  std::fprintf(stderr, "profile: roofs on %d threads: GEMM %.1f GFLOP/s (fp32 %d^3), copy %.1f GB/s\n",
               gemm_thread_count(), roofs.gemm_gflops, 1024, roofs.memory_gbps);
  std::fprintf(stderr, "profile %-32s %9s %6s %9s %6s %8s %6s\n", "kernel", "seconds", "calls", "GFLOP/s", "%GEMM",
               "GB/s", "%copy");
  for (const auto &[name, t] : by_kernel) {
    if (!t.calls) continue;
    const double gflops = t.flops / t.seconds / 1e9, gbps = t.bytes / t.seconds / 1e9;
    std::fprintf(stderr, "profile %-32s %9.3f %6ld %9.1f %5.0f%% %8.1f %5.0f%%\n", name.c_str(), t.seconds, t.calls,
                 gflops, 100 * gflops / roofs.gemm_gflops, gbps, 100 * gbps / roofs.memory_gbps);
  }
  // Which library kernels ran the host products, at which shapes (the GEMM bands and panels and
  // the attention's products; MKL takes other paths on Intel and AMD CPUs at the same shape).
  for (const LibraryCall &c : library)
    std::fprintf(stderr, "profile library %-32s m %6d n %6d k %6d%s%s %8ld calls\n", library_name(c.library), c.m, c.n,
                 c.k, c.trans_a ? " trans_a" : "", c.trans_b ? " trans_b" : "", c.calls);
  if (dropped) std::fprintf(stderr, "profile library: %ld calls of further shapes not listed\n", dropped);
}
}  // namespace remat::runtime
