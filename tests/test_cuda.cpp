// The GPU kernels.
// Everywhere: every CUDA kernel is PTX for the pinned compute capability (label "build"); the
// GPU schedules, generated for OpenCL, run on PoCL (OpenCL on the CPU; label "pocl") against the
// CPU kernels and across policies: this checks the schedules themselves (bounds, guards, shared
// memory, per-block recompute) without a GPU.
// On a CUDA GPU (label "gpu", scripts/device-check.sh; elsewhere they are skipped, each its own
// ctest entry, and counted as skipped):
//  - CUDA (and PoCL) results match the CPU kernels': row losses, every gradient tensor, the
//    parameters after AdamW (run from the same gradients on both sides) and the evaluation loss,
//    within the limits stated at `Tolerances` below (the GPU sums in another order than the CPU's
//    vector lanes; in bf16 that can move a value across a rounding boundary, 2^-8 relative, and
//    the difference travels on);
//  - every policy, offload included, gives the same gradients bit for bit on the device;
//  - the measured peak of the device arena (canary scan) equals the plan; kernels allocate nothing;
//  - a test-only kernel writing past the plan on the device (into the arena's guard) is caught;
//  - NCCL's collectives run over a communicator of one rank, ordered after the compute stream.
#include <boost/test/unit_test.hpp>

#include <HalideRuntime.h>

#include "cuda_device.h"
#include "nccl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <unistd.h>
#include <cstring>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>
#include "registry.h"

#include "compare.h"
#include "model_run.h"
#include "planted_fault.h"
#include "policies.h"

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

}  // namespace

namespace {

// Limits as fractions of each tensor's largest CPU magnitude (rtol 0), set just above the worst
// errors observed on PoCL (tests/compare.h; REMAT_SHOW_ERRORS=1 prints them), MLP / GPT:
//   fp32: row losses 3.3e-7 / 1.5e-7 (train), 1.9e-7 / 1.3e-7 (eval); gradients 2.3e-6 / 9.6e-7;
//         parameters after AdamW from the same gradients 9.9e-8 / 9.9e-8.
//   bf16: row losses 3.9e-3 / 1.7e-3 (train), 2.2e-3 / 1.2e-3 (eval); gradients 2.9e-2 / 1.4e-2;
//         parameters 9.9e-8 (AdamW is fp32 in both precisions).
// zoo_gated: fp32 row losses 1.3e-7 (train), 6.0e-7 (eval), gradients 5.7e-7; bf16 row losses
// 2.3e-3 (train), 1.4e-2 (eval: one row of 15, the others 2.5e-3 at most), gradients 3.4e-2. Its
// 12 features in heads of 2 amplify a bf16 rounding that differs between the CPU's Halide GEMMs
// and the GPU's library GEMMs (their summation orders differ) more than the wider models do, so
// its bf16 row losses have a limit of their own (Case::bf16_loss); fp32 agrees to 6e-7.
// CUDA (cuBLASLt's summation order) is held to the same limits; its figures are not yet observed.
struct Tolerances {
  testing::Tolerance loss, grads, params;
};
constexpr Tolerances fp32_tolerances{{2e-6, 0}, {1e-5, 0}, {5e-7, 0}}, bf16_tolerances{{1e-2, 0}, {5e-2, 0}, {5e-7, 0}};

// A model with its CPU kernels and its GPU kernels for one device; `samples` per micro-batch.
struct Case {
  const Model &m;
  std::string_view name;
  std::span<const runtime::Kernel> cpu, gpu;
  int samples;
  double dropout;
  double bf16_loss = bf16_tolerances.loss.atol;  // the bf16 row-loss limit, if not the common one
};
// The registry's models whose GPU schedules are also generated for OpenCL (tests/registry.h: the
// MLP, the GPT, and zoo_gated: RMSNorm, RoPE, grouped-query attention, SwiGLU, bias-free linears, a
// token embedding: the kinds of today's LLMs) on `device`. zoo_gated's bf16 row losses have a limit
// of their own (2e-2, observed 1.4e-2).
std::vector<Case> models_on(Device device) {
  std::vector<Case> out;
  for (const testing::TestModel &m : testing::test_models()) {
    if (m.opencl.empty()) continue;
    Case c{m.model, m.name, m.cpu, device == Device::cuda ? m.cuda : m.opencl, m.gpu_samples, m.dropout};
    if (m.name == "zoo_gated") c.bf16_loss = 2e-2;
    out.push_back(c);
  }
  BOOST_TEST_REQUIRE(!out.empty(), "no test model with OPENCL in the registry");
  return out;
}

// One training step and the optimizer on `device` against the CPU kernels: the mean loss, every
// gradient tensor, the updated parameters and the evaluation loss, for each model.
void expect_close_to_the_cpu(Device device, Precision precision = Precision::fp32) {
  for (const Case &c : models_on(device)) {
    Tolerances tol = precision == Precision::bf16 ? bf16_tolerances : fp32_tolerances;
    if (precision == Precision::bf16) tol.loss.atol = c.bf16_loss;
    Run cpu(c.m, c.name, c.cpu, none, c.samples, c.dropout, false, Device::cpu, precision);
    Run gpu(c.m, c.name, c.gpu, none, c.samples, c.dropout, true, device, precision);
    auto close = [&](std::string_view what, const std::vector<float> &want, const std::vector<float> &got,
                     std::size_t first, std::size_t n, testing::Tolerance tolerance) {
      const auto result =
          testing::compare(std::span(got).subspan(first, n), std::span(want).subspan(first, n), tolerance);
      BOOST_TEST(result.ok(), c.name << " " << what << ": " << result.describe());
      if (testing::show_errors()) BOOST_TEST_MESSAGE(c.name << " " << what << ": " << result.describe());
    };
    for (Run *r : {&cpu, &gpu}) r->ex.run(Executor::Phase::train);
    const auto loss_cpu = cpu.read(cpu.plan.row_loss()), loss_gpu = gpu.read(gpu.plan.row_loss());
    close("row_loss", loss_cpu, loss_gpu, 0, loss_cpu.size(), tol.loss);
    const auto g_cpu = cpu.grads(), g_gpu = gpu.grads();
    for (const Tensor &t : cpu.plan.tensors)
      if (t.role == Role::grads && t.key.layer >= 0)
        close(name_of(t.key).view(), g_cpu, g_gpu, t.offset / 4, t.bytes() / 4, tol.grads);
    // AdamW from the same gradients on both sides: its update is about lr x sign(g), so feeding it
    // each side's own gradients would turn a rounding difference in a near-zero gradient into a
    // difference of 2 lr in the parameter, and compare nothing of the AdamW kernel itself.
    std::ranges::copy(g_cpu, gpu.ex.tensor<float>(gpu.plan.grads()).begin());
    gpu.ex.upload(gpu.plan.grads());
    for (Run *r : {&cpu, &gpu}) {
      r->scalars.lr = 1e-2f;
      r->scalars.bias1 = 0.1f;
      r->scalars.bias2 = 0.001f;
      r->scalars.weight_decay = 0.01f;
      r->ex.run(Executor::Phase::optimize);
    }
    const auto p_cpu = cpu.read(cpu.plan.params()), p_gpu = gpu.read(gpu.plan.params());
    close("params after AdamW", p_cpu, p_gpu, 0, p_cpu.size(), tol.params);
    for (Run *r : {&cpu, &gpu}) r->ex.run(Executor::Phase::eval);
    const auto e_cpu = cpu.read(cpu.plan.row_loss()), e_gpu = gpu.read(gpu.plan.row_loss());
    close("eval row_loss", e_cpu, e_gpu, 0, e_cpu.size(), tol.loss);
  }
}

// Every policy, offload included, gives the gradients of `none` bit for bit on `device`, for the
// models with repeat stages (the GPT and zoo_gated), at `scale` times their case's samples.
void expect_policies_identical(Device device, int scale, Precision precision = Precision::fp32) {
  for (const Case &c : models_on(device)) {
    if (c.name == "mlp") continue;  // its policies are the GPT's on a simpler block
    Run base(c.m, c.name, c.gpu, none, scale * c.samples, c.dropout, true, device, precision);
    base.ex.run(Executor::Phase::train);
    const auto expected = base.grads();
    // two runs that both left NaN (the canary) or zeros would compare equal
    BOOST_TEST_REQUIRE(
        testing::finite_and_nonzero(expected),
        c.name << " " << precision_name(precision) << " gradients under none: not all finite, or all zero");
    // annotated(selective): zoo_gated's first stage offloads its "gate" internals
    for (const StagePolicies &p : testing::fixed_policies(c.m)) {
      Run run(c.m, c.name, c.gpu, p, scale * c.samples, c.dropout, true, device, precision);
      run.ex.run(Executor::Phase::train);
      const auto got = run.grads();
      BOOST_TEST(
          std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0,
          c.name << " " << precision_name(precision) << " gradients differ under " << policies_name(c.m, p).view());
    }
  }
}

}  // namespace

// Every test model's CUDA kernels (the registry's).
BOOST_AUTO_TEST_CASE(cuda_kernels_are_ptx_for_the_pinned_capability, *boost::unit_test::label("build")) {
  for (const testing::TestModel &m : testing::test_models()) {
    const std::string lib(m.archive);
    const std::size_t count = m.cuda.size();
    BOOST_TEST_REQUIRE(count > 0u, lib << ": no CUDA kernels in the table");
    const std::string bytes = read_file(lib.c_str());
    const std::regex target(R"(\n\.target (sm_[0-9]+))");
    std::size_t pinned = 0, other = 0;
    for (auto it = std::sregex_iterator(bytes.begin(), bytes.end(), target); it != std::sregex_iterator(); ++it)
      ((*it)[1] == "sm_" REMAT_CUDA_CAPABILITY ? pinned : other) += 1;
    // one module per kernel with GPU loops (a kernel that is only library GEMMs has none)
    BOOST_TEST((pinned > count / 2 && pinned <= count),
               lib << ": " << pinned << " PTX modules for " << count << " CUDA kernels");
    BOOST_TEST(other == 0u);
  }
}

// The PTX modules of a kernel library, as the model compiler embedded them.
std::vector<std::string> ptx_modules(const std::string &bytes) {
  std::vector<std::string> modules;
  const std::string header = "// Generated by LLVM NVPTX Back-End";
  for (auto at = bytes.find(header); at != std::string::npos; at = bytes.find(header, at + 1))
    modules.push_back(bytes.substr(at, bytes.find('\0', at) - at));
  return modules;
}

// The model of a kernel library: <dir>/lib<model>_kernels.a
std::string model_of(const std::string &lib) {
  const std::string stem = std::filesystem::path(lib).stem().string();
  return stem.substr(3, stem.size() - 3 - std::string_view("_kernels").size());
}

// The kernel libraries whose PTX the build tests read: the test models', the Llama example's and
// GPT-2 small's (bench/gpt2s.cppm: the real widths and context).
std::vector<std::string> cuda_libraries() {
  std::vector<std::string> libraries = {GPT2S_KERNELS_LIB, LLAMA_KERNELS_LIB};
  for (const testing::TestModel &m : testing::test_models()) libraries.emplace_back(m.archive);
  return libraries;
}

// The PTX lint. The CPU kernels keep every float multiply and add apart (strict_float), so must
// the CUDA kernels (generators/cuda_strict.h), or a recompute kernel could round differently from
// the forward kernel it reproduces: no module holds an f32 add, sub or mul printed without a
// rounding mode (ptxas may contract those into an fma), nor a fused multiply-add, with one allowed
// use and its reason:
// - fma.rn.ftz.f32 in the models with RoPE (llama, zoo_gated, smol_tiny): libdevice's sinf and
//   cosf, which the RoPE angles call on the GPU, evaluate their polynomials with fmas. These are
//   fixed functions (the same bits in every kernel that calls them: a recompute reproduces its
//   forward). libdevice is compiled flush-to-zero, Halide's own arithmetic in these kernels is not:
//   a contraction of Halide's would print as fma.rn.f32 and fail here in every model.
BOOST_AUTO_TEST_CASE(cuda_kernels_keep_multiplies_and_adds_apart, *boost::unit_test::label("build")) {
  const std::set<std::string> calls_sin_cos = {"llama", "zoo_gated", "smol_tiny"};
  const std::regex fused(R"(^\s*(@%p\d+\s+)?fma\.)"), libdevice_fma(R"(^\s*(@%p\d+\s+)?fma\.rn\.ftz\.f32\s)"),
      contractable(R"(^\s*(@%p\d+\s+)?(add|sub|mul)(\.ftz)?(\.sat)?\.f32\s)"),
      rounded(R"(^\s*(@%p\d+\s+)?(add|sub|mul|div)\.rn(\.ftz)?(\.sat)?\.f32\s)"), entry(R"(\.entry\s+(\w+))");
  for (const std::string &lib : cuda_libraries()) {
    const bool allowed_fma = calls_sin_cos.contains(model_of(lib));
    std::size_t kernels = 0, checked = 0, offending = 0, allowed = 0;
    for (const std::string &module : ptx_modules(read_file(lib.c_str()))) {
      std::istringstream lines(module);
      std::string kernel = "(before the first .entry)";
      for (std::string line; std::getline(lines, line);) {
        std::smatch m;
        if (std::regex_search(line, m, entry)) {
          kernel = m[1];
          ++kernels;
        }
        const bool is_fma = std::regex_search(line, fused);
        const bool ok = is_fma && allowed_fma && std::regex_search(line, libdevice_fma);
        const bool bad = !ok && (is_fma || std::regex_search(line, contractable));
        allowed += ok;
        checked += is_fma || bad || std::regex_search(line, rounded);
        if (bad && ++offending <= 5) BOOST_ERROR(lib << ": " << kernel << ": " << line);
      }
    }
    BOOST_TEST(offending == 0u, lib << ": " << offending << " fused or contractable float instructions");
    BOOST_TEST(kernels > 0u, lib << ": no CUDA kernels");
    BOOST_TEST_MESSAGE(model_of(lib) << ": " << kernels << " CUDA kernels, " << checked
                                     << " f32 adds, subs, multiplies, divisions and fmas: " << offending
                                     << " fused or contractable, " << allowed << " libdevice fmas (sinf, cosf)");
  }
}

// A kernel library's CUDA launches as the model compiler read them off each pipeline's lowered
// code (generators/cuda_launches.h) into <model>.cuda-launches.txt: "rows_per_sample N", then a
// line a GPU kernel, "<pipeline> <GPU kernel> grid X Y Z block X Y Z shared BYTES", "rows" for an
// extent that grows with the rows (taken here at batch 64: 64 x rows_per_sample). A pipeline's
// lines come together, pipelines in the order of the library's PTX modules (one each).
struct LaunchReport {
  struct Pipeline {
    std::string name;
    std::vector<std::pair<std::string, cuda::Launch>> launches;  // GPU kernel, launch
    unsigned threads() const {
      unsigned most = 0;
      for (const auto &[_, l] : launches) most = std::max(most, l.block[0] * l.block[1] * l.block[2]);
      return most;
    }
  };
  unsigned rows_per_sample = 0;
  std::vector<Pipeline> pipelines;
};
LaunchReport launch_report(const std::string &lib) {
  const std::string model = model_of(lib);
  std::ifstream in(std::filesystem::path(lib).parent_path() / (model + ".cuda-launches.txt"));
  BOOST_TEST_REQUIRE(bool(in), lib << ": no " << model << ".cuda-launches.txt next to it");
  LaunchReport report;
  std::string word;
  in >> word >> report.rows_per_sample;
  BOOST_TEST_REQUIRE((word == "rows_per_sample" && report.rows_per_sample > 0), model << ": the report's first line");
  for (std::string line; std::getline(in >> std::ws, line);) {
    std::istringstream fields(line);
    std::string pipeline, kernel, grid_word, block_word, shared_word, extent[7];
    fields >> pipeline >> kernel >> grid_word >> extent[0] >> extent[1] >> extent[2] >> block_word >> extent[3] >>
        extent[4] >> extent[5] >> shared_word >> extent[6];
    BOOST_TEST_REQUIRE((bool(fields) && grid_word == "grid" && block_word == "block" && shared_word == "shared"),
                       model << ": not a launch: " << line);
    unsigned v[7];
    for (int i = 0; i < 7; ++i)
      v[i] = extent[i] == "rows" ? 64 * report.rows_per_sample : unsigned(std::stoul(extent[i]));
    if (report.pipelines.empty() || report.pipelines.back().name != pipeline)
      report.pipelines.push_back({pipeline, {}});
    report.pipelines.back().launches.push_back({kernel, {{v[0], v[1], v[2]}, {v[3], v[4], v[5]}, v[6]}});
  }
  return report;
}

std::size_t entries(const std::string &module) {
  static const std::regex entry(R"(\.entry\s+_kernel_)");
  return std::distance(std::sregex_iterator(module.begin(), module.end(), entry), std::sregex_iterator());
}

// The launch-limit test. The model compiler refuses a CUDA kernel that cannot launch on an H100
// at every row count (the grid's y and z, the block and its shared memory constant and within the
// limits; only x grows with the rows). Here, from its report: one line for each GPU kernel of each
// PTX module (the list misses none), and each launch at batch 64 passes the check every launch
// passes on the device (cuda::launch_problem, against an H100's limits; each of today's schedules
// has a block cover a row or more, so a grid x of 64 samples' rows bounds them). Launches above
// 48 KiB of shared memory rely on that check's opt-in (runtime/cuda_device.cpp): counted, printed.
BOOST_AUTO_TEST_CASE(cuda_launches_fit_an_h100, *boost::unit_test::label("build")) {
  for (const std::string &lib : cuda_libraries()) {
    const std::string model = model_of(lib);
    const LaunchReport report = launch_report(lib);
    const auto modules = ptx_modules(read_file(lib.c_str()));
    BOOST_TEST_REQUIRE(report.pipelines.size() == modules.size(), model << ": " << report.pipelines.size()
                                                                        << " pipelines with launches, "
                                                                        << modules.size() << " PTX modules");
    std::size_t launches = 0, opt_in = 0;
    unsigned most_shared = 0, most_threads = 0;
    for (std::size_t i = 0; i < modules.size(); ++i) {
      const LaunchReport::Pipeline &p = report.pipelines[i];
      BOOST_TEST(p.launches.size() == entries(modules[i]), model << ": " << p.name << ": " << p.launches.size()
                                                                 << " launches listed, " << entries(modules[i])
                                                                 << " GPU kernels in its PTX");
      for (const auto &[kernel, launch] : p.launches) {
        const std::string problem = cuda::launch_problem(launch);
        BOOST_TEST(problem.empty(), model << ": " << p.name << " " << kernel << ": " << problem);
        ++launches;
        opt_in += launch.shared > cuda::LaunchLimits{}.shared_default;
        most_shared = std::max(most_shared, launch.shared);
      }
      most_threads = std::max(most_threads, p.threads());
    }
    BOOST_TEST_MESSAGE(model << ": " << launches << " launches fit an H100 at batch 64 x " << report.rows_per_sample
                             << " rows; at most " << most_threads << " threads and " << most_shared
                             << " bytes of shared memory a block; " << opt_in << " above 48 KiB (opted in)");
  }
}

// ptxas (from the CUDA toolkit) assembles every CUDA kernel of the test models, the Llama example and
// GPT-2 small for the pinned capability and for the H200's sm_90, which the driver will JIT-compile
// it for: invalid PTX, or a kernel needing more shared memory or registers than the GPU has, fails
// here rather than on the device. For sm_90 (-v) each kernel's registers are read: a block of a
// pipeline's most threads (its launch report) must find them in an SM's 65,536 (else the launch
// fails with "too many resources requested"), and nothing spills to local memory.
boost::test_tools::assertion_result has_ptxas(boost::unit_test::test_unit_id) {
  if (std::string_view(REMAT_PTXAS).empty()) {
    std::printf("[SKIP] no ptxas (CUDA toolkit) in this build\n");
    return false;
  }
  return true;
}

BOOST_AUTO_TEST_CASE(cuda_kernels_assemble_for_real_gpus,
                     *boost::unit_test::label("build") * boost::unit_test::precondition(has_ptxas)) {
  const std::string ptxas = REMAT_PTXAS;
  const auto dir = std::filesystem::temp_directory_path() / ("remat-ptx-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::size_t assembled = 0;
  const std::regex used(R"(Used (\d+) registers)"), spills(R"((\d+) bytes spill stores)");
  for (const std::string &lib : cuda_libraries()) {
    const auto modules = ptx_modules(read_file(lib.c_str()));
    const LaunchReport report = launch_report(lib);
    BOOST_TEST_REQUIRE(report.pipelines.size() == modules.size(), lib);
    unsigned most_registers = 0, spilled = 0;
    for (std::size_t i = 0; i < modules.size(); ++i) {
      const auto ptx = dir / (std::to_string(i) + ".ptx");
      std::ofstream(ptx) << modules[i];
      for (const std::string arch : {"sm_" REMAT_CUDA_CAPABILITY, "sm_90"}) {
        const std::string cmd = ptxas + " -arch=" + arch + (arch == "sm_90" ? " -v " : " ") + ptx.string() + " -o " +
                                (dir / "out.cubin").string() + " > " + (dir / "log").string() + " 2>&1";
        const bool ok = std::system(cmd.c_str()) == 0;
        const std::string log = read_file((dir / "log").c_str());
        BOOST_TEST(ok, lib << " module " << i << " for " << arch << ": " << log);
        assembled += ok;
        if (arch != "sm_90") continue;
        const unsigned threads = report.pipelines[i].threads();
        for (auto m = std::sregex_iterator(log.begin(), log.end(), used); m != std::sregex_iterator(); ++m) {
          const unsigned registers = std::stoul((*m)[1]);
          most_registers = std::max(most_registers, registers);
          BOOST_TEST(registers * threads <= 65536u, lib << ": " << report.pipelines[i].name << ": " << registers
                                                        << " registers x " << threads << " threads a block");
        }
        for (auto m = std::sregex_iterator(log.begin(), log.end(), spills); m != std::sregex_iterator(); ++m)
          spilled += std::stoul((*m)[1]);
      }
    }
    BOOST_TEST(spilled == 0u, lib << ": " << spilled << " bytes of spill stores");
    BOOST_TEST_MESSAGE(model_of(lib) << ": at most " << most_registers << " registers a thread (sm_90)");
  }
  std::filesystem::remove_all(dir);
  BOOST_TEST_MESSAGE(assembled << " PTX modules assembled");
}

BOOST_AUTO_TEST_CASE(pocl_gpu_schedules_match_the_cpu, *boost::unit_test::label("pocl")) {
  expect_close_to_the_cpu(Device::opencl);
}

BOOST_AUTO_TEST_CASE(pocl_gpu_schedules_give_bit_identical_gradients, *boost::unit_test::label("pocl")) {
  expect_policies_identical(Device::opencl, 1);
}

BOOST_AUTO_TEST_CASE(pocl_bf16_gpu_schedules_match_the_cpu, *boost::unit_test::label("pocl")) {
  expect_close_to_the_cpu(Device::opencl, Precision::bf16);
}

BOOST_AUTO_TEST_CASE(pocl_bf16_gpu_schedules_give_bit_identical_gradients, *boost::unit_test::label("pocl")) {
  expect_policies_identical(Device::opencl, 1, Precision::bf16);
}

BOOST_AUTO_TEST_CASE(cuda_gradients_match_the_cpu,
                     *boost::unit_test::label("gpu") * boost::unit_test::precondition(cuda_device)) {
  expect_close_to_the_cpu(Device::cuda);
}

BOOST_AUTO_TEST_CASE(cuda_policies_give_bit_identical_gradients,
                     *boost::unit_test::label("gpu") * boost::unit_test::precondition(cuda_device)) {
  expect_policies_identical(Device::cuda, 2);
}

BOOST_AUTO_TEST_CASE(cuda_bf16_gradients_match_the_cpu,
                     *boost::unit_test::label("gpu") * boost::unit_test::precondition(cuda_device)) {
  expect_close_to_the_cpu(Device::cuda, Precision::bf16);
}

BOOST_AUTO_TEST_CASE(cuda_bf16_policies_give_bit_identical_gradients,
                     *boost::unit_test::label("gpu") * boost::unit_test::precondition(cuda_device)) {
  expect_policies_identical(Device::cuda, 2, Precision::bf16);
}

BOOST_AUTO_TEST_CASE(cuda_measured_peak_equals_the_plan,
                     *boost::unit_test::label("gpu") * boost::unit_test::precondition(cuda_device)) {
  for (auto [p, precision] : {std::pair{none, Precision::fp32},
                              {selective, Precision::fp32},
                              {with_offload(full), Precision::fp32},
                              {with_offload(full), Precision::bf16}}) {
    Run run(gpt::model, "gpt", gpt_kernels::cuda_table, p, 4, 0.1, true, Device::cuda, precision);
    runtime::reset_halide_heap_peak();
    run.ex.run(Executor::Phase::train);
    run.ex.run(Executor::Phase::optimize);
    BOOST_TEST(run.arena.high_water() == run.plan.peak_bytes, policy_name(p).view());
    BOOST_TEST(runtime::halide_heap().peak == 0u);
  }
}

namespace {

// The planted overrun on the device: 2 zero bytes (not the canary) just past the buffer, queued
// on the compute stream after the real kernel.
void overrun_on_the_device(halide_buffer_t *buf) {
  static const std::uint8_t zeros[2] = {};
  cuda::copy_to_device(reinterpret_cast<void *>(buf->device + buf->size_in_bytes()), zeros, sizeof zeros,
                       cuda::Stream::compute);
}

}  // namespace

// A test-only kernel table: the GPT's CUDA kernel that writes the tensor ending at the plan's
// peak runs, then writes 2 bytes past that tensor on the device, into the guard. The run stops
// with the executor's error (after the phase; with REMAT_CUDA_SYNC=1 after that kernel, naming it).
BOOST_AUTO_TEST_CASE(cuda_write_past_the_plan_is_caught,
                     *boost::unit_test::label("gpu") * boost::unit_test::precondition(cuda_device)) {
  const int samples = 2;
  const Plan plan = make_plan(gpt::model, none, samples, Precision::fp32);
  const testing::Site site = testing::overrun_site(plan, testing::Landing::guard, "gpt");
  BOOST_TEST_REQUIRE(site.step >= 0, "no train step writes a tensor that ends at the plan's peak");
  const std::vector<runtime::Kernel> faulty =
      testing::with_overrun(gpt_kernels::cuda_table, site, overrun_on_the_device);
  Run run(gpt::model, "gpt", faulty, none, samples, 0.1, true, Device::cuda);
  BOOST_TEST_REQUIRE(run.arena.size() == plan.peak_bytes,
                     "the arena is not the train plan's size: the guard is elsewhere");
  BOOST_TEST_MESSAGE("planted: 2 bytes past " << name_of(site.arg->key).view() << " of " << site.kernel
                                              << " (train step " << site.step << ")");
  try {
    run.ex.run(Executor::Phase::train);
    BOOST_FAIL("the write past the plan on the device went unnoticed");
  } catch (const std::runtime_error &e) {
    const std::string what = e.what();
    BOOST_TEST(what.find("wrote past the end of the arena") != std::string::npos, what);
  }
  BOOST_TEST(testing::planted.call > site.call, "the faulty kernel's call was not reached");
}

// NCCL over a communicator of one rank (the only kind a machine with one GPU makes: NCCL refuses
// two ranks on one device), queued on the collectives stream after an event of the compute stream
// as the data-parallel trainers queue their buckets: a sum over one rank is its own values, in
// place. The trainers run the whole NCCL path over one rank in scripts/device-check.sh
// (REMAT_DATA_PARALLEL=1); more ranks need more GPUs.
BOOST_AUTO_TEST_CASE(cuda_nccl_collectives_over_one_rank,
                     *boost::unit_test::label("gpu") * boost::unit_test::precondition(cuda_device)) {
  cuda::init();
  BOOST_TEST_MESSAGE("NCCL " << cuda::Nccl::version());
  cuda::Nccl nccl(cuda::nccl_unique_id(), 0, 1);
  std::vector<float> values(3000), back(3000, 0.f);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = float(i) * 0.25f - 100.f;
  auto *device = static_cast<float *>(cuda::device_malloc(values.size() * sizeof(float)));
  const cuda::Event written = cuda::event_create(), summed = cuda::event_create();
  cuda::copy_to_device(device, values.data(), values.size() * sizeof(float), cuda::Stream::compute);
  cuda::record(written, cuda::Stream::compute);
  cuda::wait(cuda::Stream::collectives, written);
  nccl.group_start();
  nccl.all_reduce(device, 1000);
  nccl.reduce(device + 1000, 1000, 0);
  nccl.group_end();
  nccl.broadcast(device + 2000, 1000, 0);
  cuda::record(summed, cuda::Stream::collectives);
  cuda::wait(cuda::Stream::compute, summed);
  cuda::copy_to_host(back.data(), device, values.size() * sizeof(float), cuda::Stream::compute);
  cuda::synchronize(cuda::Stream::compute);
  nccl.check();
  BOOST_TEST(back == values, boost::test_tools::per_element());
  cuda::event_destroy(written);
  cuda::event_destroy(summed);
  cuda::device_free(device);
}
