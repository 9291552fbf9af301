// The GPU benchmark: the GPT at GPT-2-small shape (bench/gpt2s.cppm), bf16 by default (fp32 with
// --precision fp32), on CUDA under the policies
// none, full, every_n_layers=2, selective and full+offload: tokens/s of whole training steps
// (forward, backward, AdamW), planned and measured peak device memory, activation bytes, and the
// first step's gradient digest (the same for every policy). Prints a table with ratios against
// none and writes the rows as JSON for bench/torch_gpt2.py, which runs the same model in PyTorch
// and prints both side by side. A policy that fails gives an error row (the others still run);
// the JSON is always written, also without a GPU (then [SKIP], a "skipped" record and exit 0).
// A measured peak other than the planned one is a failure too (an "error" in its row, exit 1).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cuda_device.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
import remat;
import remat.runtime;
import gpt2s;
import gpt2s.kernels;

using namespace remat;
using remat::runtime::Executor;

namespace {

// One policy: a warm-up step (its gradients and peak are the figures), then `steps` timed steps.
nlohmann::json run_policy(Policy p, int batch, int steps, Precision precision, double &base_rate) {
  const long long tokens = (long long)batch * gpt2s::block_size;
  const Plan plan = make_plan(gpt2s::model, p, batch, precision);
  const std::size_t arena_bytes = std::max(plan.peak_bytes, plan.eval_peak_bytes);
  if (const std::size_t free_bytes = cuda::probe().free_bytes; arena_bytes > free_bytes) {
    const std::string why =
        fmt::format("the plan needs {} B, more than the {} B of free device memory", arena_bytes, free_bytes);
    fmt::print("{:<18} skipped: {}\n", policy_name(p).view(), why);
    return {{"policy", std::string(policy_name(p).view())}, {"skipped", why}};
  }
  runtime::Engine engine(plan, "gpt2s", gpt2s_kernels::cuda_table, {.device = runtime::Device::cuda});
  runtime::Arena &arena = engine.arena;
  runtime::Scalars &scalars = engine.scalars;
  Executor &ex = engine.executor;
  engine.init_params(1);  // as the trainer starts them
  std::mt19937_64 rng(1);
  for (auto &t : ex.tensor<std::int32_t>(plan.inputs())) t = int(rng() % gpt2s::vocab);
  for (auto &l : ex.tensor<std::int32_t>(plan.labels())) l = int(rng() % gpt2s::vocab);
  ex.upload(plan.inputs());
  ex.upload(plan.labels());
  scalars.grad_scale = 1.f / float(plan.rows);
  scalars.lr = 1e-4f;
  scalars.step = 1;
  auto step = [&] {
    ex.run(Executor::Phase::train);
    ex.run(Executor::Phase::optimize);
  };
  runtime::reset_halide_heap_peak();
  ex.run(Executor::Phase::train);  // warm-up step; its gradients and peak are the figures
  ex.download(plan.grads());
  const std::string grad_digest = runtime::digest(std::as_bytes(ex.tensor<float>(plan.grads())));
  ex.run(Executor::Phase::optimize);
  const std::size_t measured = arena.high_water() + runtime::halide_heap().peak;
  arena.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) step();
  arena.synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double rate = double(tokens) * steps / seconds;
  if (p == none) base_rate = rate;
  fmt::print("{:<18} {:>10.0f} {:>9.2f} {:>16} {:>16} {:>8} {:>14.1f} {:>9}  {}\n", policy_name(p).view(), rate,
             base_rate > 0 ? rate / base_rate : 0.0, plan.peak_bytes, measured,
             measured == plan.peak_bytes ? "yes" : "NO", plan.activation_bytes / 1048576.0, plan.offload_bytes,
             grad_digest);
  nlohmann::json row{{"policy", std::string(policy_name(p).view())}, {"tokens_per_s", rate},
                     {"planned_peak_bytes", plan.peak_bytes},        {"measured_peak_bytes", measured},
                     {"peak_equal", measured == plan.peak_bytes},    {"activation_bytes", plan.activation_bytes},
                     {"offload_bytes", plan.offload_bytes},          {"grad_digest", grad_digest}};
  if (measured != plan.peak_bytes)  // a failure: the plan did not hold on the device
    row["error"] = fmt::format("measured peak {} B != planned peak {} B", measured, plan.peak_bytes);
  return row;
}

}  // namespace

int main(int argc, char **argv) {
  int batch = 8, steps = 3;
  std::string out, precision_flag = "bf16";
  CLI::App app{"remat GPU benchmark: GPT-2-small shape under checkpoint policies"};
  app.add_option("--precision", precision_flag, "bf16 (activations and GEMM operands) or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}))
      ->capture_default_str();
  app.add_option("--batch-size", batch, "sequences of 1024 tokens per step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--steps", steps, "timed steps per policy (after one warm-up step)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--out", out, "write the rows as JSON here");
  CLI11_PARSE(app, argc, argv);

  const Precision precision = precision_flag == "bf16" ? Precision::bf16 : Precision::fp32;
  nlohmann::json record{{"batch_size", batch},
                        {"block_size", gpt2s::block_size},
                        {"steps", steps},
                        {"precision", std::string(precision_name(precision))},
                        {"rows", nlohmann::json::array()}};
  // The JSON is written whatever happened, so that bench/torch_gpt2.py always finds it.
  auto finish = [&](int status) {
    std::fflush(stdout);
    if (out.empty()) return status;
    std::ofstream f(out);
    f << record.dump(1) << '\n';
    if (!f) {
      std::fprintf(stderr, "bench-gpu: error: cannot write %s\n", out.c_str());
      return 2;
    }
    return status;
  };
  const cuda::DeviceInfo device = cuda::probe();
  if (!device.error.empty()) {
    std::printf("[SKIP] no CUDA device (%s)\n", device.error.c_str());
    record["skipped"] = "no CUDA device (" + device.error + ")";
    return finish(0);
  }
  record["device"] = device.name;
  const Policy policies[] = {none, full, Policy{Policy::Kind::every_n_layers, 2}, selective, with_offload(full)};
  fmt::print(
      "remat on {} ({} MiB free): GPT-2-small shape, {} layers, {} wide, {} heads, T={}, vocab {}, batch {} "
      "({} tokens/step), {}, {} timed steps\n",
      device.name, device.free_bytes >> 20, gpt2s::n_layer, gpt2s::n_embd, gpt2s::n_head, gpt2s::block_size,
      gpt2s::vocab, batch, (long long)batch * gpt2s::block_size, precision_name(precision), steps);
  fmt::print("{:<18} {:>10} {:>9} {:>16} {:>16} {:>8} {:>14} {:>9}  {}\n", "policy", "tokens/s", "vs none",
             "planned peak B", "measured peak B", "equal", "activations MiB", "offload", "grad digest");
  int status = 0;
  double base_rate = 0;
  for (Policy p : policies) {
    try {
      nlohmann::json row = run_policy(p, batch, steps, precision, base_rate);
      if (row.contains("error")) {  // it ran, but measured != planned peak
        fmt::print("{:<18} error: {}\n", policy_name(p).view(), row["error"].get<std::string>());
        status = 1;
      }
      record["rows"].push_back(std::move(row));
    } catch (const std::exception &e) {  // e.g. a failing kernel: the other policies still run
      fmt::print("{:<18} error: {}\n", policy_name(p).view(), e.what());
      record["rows"].push_back({{"policy", std::string(policy_name(p).view())}, {"error", e.what()}});
      status = 1;
    }
    std::fflush(stdout);
  }
  return finish(status);
}
