// Step time and memory of the example models under every checkpoint policy (and the GPT's in
// bf16 too), measured in one run, with the ratios against fp32 `none` side by side. Policies are interleaved round by
// round so that machine noise hits all of them alike; the figure per policy is the median step.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>
import remat;
import remat.runtime;
import mlp;
import mlp.kernels;
import gpt;
import gpt.kernels;

using namespace remat;
using remat::runtime::Executor;

namespace {

struct Config {
  Policy policy;
  Precision precision = Precision::fp32;
  std::string name() const {
    return fmt::format("{}{}", policy_name(policy).view(), precision == Precision::bf16 ? " bf16" : "");
  }
};

struct Case {
  Config config;
  std::unique_ptr<runtime::Engine> engine;
  const Plan *plan = nullptr;
  runtime::Arena *arena = nullptr;
  runtime::Scalars *scalars = nullptr;
  Executor *ex = nullptr;
  std::vector<double> ms;
  std::size_t measured_peak = 0;
};

void bench(const char *title, const char *name, const Model &model, std::span<const runtime::Kernel> kernels, int batch,
           int rounds, const std::vector<Config> &configs) {
  std::vector<std::unique_ptr<Case>> cases;
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (const Config &config : configs) {
    auto c = std::make_unique<Case>();
    c->config = config;
    c->engine =
        std::make_unique<runtime::Engine>(make_plan(model, config.policy, batch, config.precision), name, kernels);
    c->plan = &c->engine->plan;
    c->arena = &c->engine->arena;
    c->scalars = &c->engine->scalars;
    c->ex = &c->engine->executor;
    const Plan &plan = *c->plan;
    for (TensorId root : {plan.params(), plan.adam_m(), plan.adam_v()})
      for (float &x : c->ex->tensor<float>(root)) x = 0.01f * u(rng);
    std::ranges::fill(c->ex->tensor<float>(plan.grads()), 0.f);  // the padding between parameters stays 0
    if (model.token_input())
      for (auto &t : c->ex->tensor<std::int32_t>(plan.inputs())) t = int(rng() % model.input.vocab);
    else {
      std::vector<float> images(plan.tensors[plan.inputs().index].bytes() / c->ex->element_size(plan.inputs()));
      for (float &x : images) x = u(rng);
      c->ex->set_values(plan.inputs(), images);
    }
    for (auto &l : c->ex->tensor<std::int32_t>(plan.labels())) l = int(rng() % model.classes());
    c->scalars->grad_scale = 1.f / float(c->plan->rows);
    c->scalars->lr = 1e-4f;
    cases.push_back(std::move(c));
  }
  for (int r = 0; r <= rounds; ++r)
    for (auto &c : cases) {
      const auto t0 = std::chrono::steady_clock::now();
      c->ex->run(Executor::Phase::train);
      c->ex->run(Executor::Phase::optimize);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r == 0)
        c->measured_peak = c->arena->high_water();  // round 0 is warm-up
      else
        c->ms.push_back(ms);
    }
  auto median = [](std::vector<double> v) {
    std::ranges::sort(v);
    return v[v.size() / 2];
  };
  const double base_ms = median(cases[0]->ms), base_act = double(cases[0]->plan->activation_bytes);
  fmt::print("{}, batch {} ({} rows); median of {} interleaved steps (forward, backward, AdamW)\n", title, batch,
             cases[0]->plan->rows, rounds);
  fmt::print("{:<22} {:>9} {:>10} {:>14} {:>14} {:>12} {:>10} {:>9}\n", "policy", "step ms", "rows/s", "activations",
             "planned peak", "measured", "step/none", "act/none");
  for (auto &c : cases) {
    const double ms = median(c->ms);
    fmt::print("{:<22} {:>9.1f} {:>10.0f} {:>10.1f} MiB {:>10.1f} MiB {:>8.1f} MiB {:>10.2f} {:>9.3f}\n",
               c->config.name(), ms, c->plan->rows * 1000.0 / ms, c->plan->activation_bytes / 1048576.0,
               c->plan->peak_bytes / 1048576.0, c->measured_peak / 1048576.0, ms / base_ms,
               c->plan->activation_bytes / base_act);
  }
  for (auto &c : cases)
    if (c->config.policy == full || c->config.policy == selective || c->config.precision == Precision::bf16)
      fmt::print("ratio step({})/step(none) = {:.2f}\n", c->config.name(), median(c->ms) / base_ms);
  fmt::print("\n");
  for (auto &c : cases)
    if (c->measured_peak != c->plan->peak_bytes)
      throw std::runtime_error(fmt::format("{} {}: measured peak {} B, planned {} B", name, c->config.name(),
                                           c->measured_peak, c->plan->peak_bytes));
}

}  // namespace

int main(int argc, char **argv) try {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 10;
  if (rounds < 1) {
    std::fprintf(stderr, "usage: bench-policies [ROUNDS >= 1]\n");
    return 2;
  }
  const Policy every_2{Policy::Kind::every_n_layers, 2};
  bench(fmt::format("MLP: {} blocks, width {}, hidden {}", mlp::blocks, mlp::width, mlp::hidden).c_str(), "mlp",
        mlp::model, mlp_kernels::table, 256, rounds,
        {{none}, {selective}, {every_2}, {sqrt_n}, {full}, {none, Precision::bf16}});
  bench(
      fmt::format("GPT: {} blocks, {} wide, {} heads, T = {}", gpt::n_layer, gpt::n_embd, gpt::n_head, gpt::block_size)
          .c_str(),
      "gpt", gpt::model, gpt_kernels::table, gpt::default_batch, rounds,
      {{none},
       {selective},
       {every_2},
       {sqrt_n},
       {full},
       {none, Precision::bf16},
       {selective, Precision::bf16},
       {full, Precision::bf16}});
  return 0;
} catch (const std::exception &e) {
  std::fprintf(stderr, "bench-policies: %s\n", e.what());
  return 1;
}
