// The CUDA kernels. Without a GPU (CI) only the build is checked: every CUDA kernel is PTX for
// the pinned compute capability; the tests that run kernels print "[SKIP] no CUDA device".
// On a GPU (scripts/device-check.sh):
//  - CUDA gradients match the CPU's: each gradient tensor within 1e-3 of its largest CPU
//    magnitude (both float32; the GPU sums in another order, serially per thread, than the CPU's
//    vector lanes), the mean loss within 1e-5 relative;
//  - every policy, offload included, gives the same gradients bit for bit on the GPU;
//  - the measured peak of the device arena (canary scan) equals the plan; kernels allocate nothing.
#include <boost/test/unit_test.hpp>

#include "cuda_device.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>
import remat;
import remat.runtime;
import mlp;
import mlp.kernels;
import gpt;
import gpt.kernels;

#include "model_run.h"

using namespace remat;
using remat::runtime::Device;
using remat::runtime::Executor;

namespace {

boost::test_tools::assertion_result cuda_device(boost::unit_test::test_unit_id) {
  static const cuda::DeviceInfo info = cuda::probe();
  if (!info.error.empty()) {
    std::printf("[SKIP] no CUDA device (%s)\n", info.error.c_str());
    return false;
  }
  std::printf("CUDA device: %s, compute capability %d.%d, %zu MiB free\n", info.name.c_str(), info.major, info.minor,
              info.free_bytes >> 20);
  return true;
}

std::string read_file(const char *path) {
  std::ifstream in(path, std::ios::binary);
  BOOST_TEST_REQUIRE(bool(in), "cannot read " << path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

constexpr Policy every_2{Policy::Kind::every_n_layers, 2};

}  // namespace

BOOST_AUTO_TEST_CASE(cuda_kernels_are_ptx_for_the_pinned_capability) {
  for (auto [lib, count] : {std::pair{MLP_KERNELS_LIB, mlp_kernels::cuda_table.size()},
                            std::pair{GPT_KERNELS_LIB, gpt_kernels::cuda_table.size()}}) {
    BOOST_TEST_REQUIRE(count > 0u, "no CUDA kernels in the table");
    const std::string bytes = read_file(lib);
    const std::regex target(R"(\n\.target (sm_[0-9]+))");
    std::size_t pinned = 0, other = 0;
    for (auto it = std::sregex_iterator(bytes.begin(), bytes.end(), target); it != std::sregex_iterator(); ++it)
      ((*it)[1] == "sm_" REMAT_CUDA_CAPABILITY ? pinned : other) += 1;
    BOOST_TEST(pinned == count, lib << ": " << pinned << " PTX modules for " << count << " CUDA kernels");
    BOOST_TEST(other == 0u);
  }
}

BOOST_AUTO_TEST_CASE(cuda_gradients_match_the_cpu, *boost::unit_test::precondition(cuda_device)) {
  struct Case { const Model &m; std::string_view name; std::span<const runtime::Kernel> cpu, gpu; int samples; double dropout; };
  for (const Case &c : {Case{mlp::model, "mlp", mlp_kernels::table, mlp_kernels::cuda_table, 64, 0.0},
                        Case{gpt::model, "gpt", gpt_kernels::table, gpt_kernels::cuda_table, 4, 0.1}}) {
    Run cpu(c.m, c.name, c.cpu, none, c.samples, c.dropout);
    Run gpu(c.m, c.name, c.gpu, none, c.samples, c.dropout, false, Device::cuda);
    cpu.ex.run(Executor::Phase::train);
    gpu.ex.run(Executor::Phase::train);
    double loss_cpu = 0, loss_gpu = 0;
    for (float l : cpu.read("row_loss")) loss_cpu += l;
    for (float l : gpu.read("row_loss")) loss_gpu += l;
    BOOST_TEST(std::abs(loss_gpu - loss_cpu) <= 1e-5 * std::abs(loss_cpu), c.name << " loss " << loss_gpu << " vs " << loss_cpu);
    const auto g_cpu = cpu.grads(), g_gpu = gpu.grads();
    for (const Tensor &t : cpu.plan.tensors) {
      if (t.role != Role::grads || t.view_of < 0 || t.name.view().find('.') == std::string_view::npos) continue;
      const std::size_t first = t.offset / 4, n = t.bytes() / 4;
      double scale = 0, err = 0;
      for (std::size_t i = first; i < first + n; ++i) {
        scale = std::max(scale, double(std::abs(g_cpu[i])));
        err = std::max(err, double(std::abs(g_gpu[i] - g_cpu[i])));
      }
      BOOST_TEST(err <= 1e-3 * scale, c.name << " " << t.name.view() << ": max error " << err << " of " << scale);
    }
  }
}

BOOST_AUTO_TEST_CASE(cuda_policies_give_bit_identical_gradients, *boost::unit_test::precondition(cuda_device)) {
  Run base(gpt::model, "gpt", gpt_kernels::cuda_table, none, 4, 0.1, true, Device::cuda);
  base.ex.run(Executor::Phase::train);
  const auto expected = base.grads();
  for (Policy p : {selective, full, every_2, sqrt_n, with_offload(full), with_offload(every_2), with_offload(sqrt_n)}) {
    Run run(gpt::model, "gpt", gpt_kernels::cuda_table, p, 4, 0.1, true, Device::cuda);
    run.ex.run(Executor::Phase::train);
    const auto got = run.grads();
    BOOST_TEST(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0,
               "gradients differ under " << policy_name(p).view());
  }
}

BOOST_AUTO_TEST_CASE(cuda_measured_peak_equals_the_plan, *boost::unit_test::precondition(cuda_device)) {
  for (Policy p : {none, selective, with_offload(full)}) {
    Run run(gpt::model, "gpt", gpt_kernels::cuda_table, p, 4, 0.1, true, Device::cuda);
    runtime::reset_halide_heap_peak();
    run.ex.run(Executor::Phase::train);
    run.ex.run(Executor::Phase::optimize);
    BOOST_TEST(run.arena.high_water() == run.plan.peak_bytes, policy_name(p).view());
    BOOST_TEST(runtime::halide_heap().peak == 0u);
  }
}
