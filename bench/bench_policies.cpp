// Step time and memory of the MLP under every checkpoint policy, measured in one run, with the
// ratios against `none` side by side. Policies are interleaved round by round so that machine
// noise hits all of them alike; the figure per policy is the median step.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>
import remat;
import remat.runtime;
import mlp;
import mlp.kernels;

using namespace remat;
using remat::runtime::Executor;

namespace {

struct Case {
  Policy policy;
  Plan plan;
  std::unique_ptr<runtime::Arena> arena;
  runtime::Scalars scalars;
  std::unique_ptr<Executor> ex;
  std::vector<double> ms;
  std::size_t measured_peak = 0;
};

}  // namespace

int main(int argc, char **argv) {
  const int batch = argc > 1 ? std::atoi(argv[1]) : mlp::default_batch;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 12;
  if (batch < 8 || rounds < 1) {
    std::fprintf(stderr, "usage: bench-policies [BATCH >= 8] [ROUNDS >= 1]\n");
    return 2;
  }
  std::vector<Policy> policies = {none, Policy{Policy::Kind::every_n_layers, 2}, sqrt_n, full};
  std::vector<std::unique_ptr<Case>> cases;
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (Policy p : policies) {
    auto c = std::make_unique<Case>();
    c->policy = p;
    c->plan = make_plan(mlp::model, p, batch);
    c->arena = std::make_unique<runtime::Arena>(std::max(c->plan.peak_bytes, c->plan.eval_peak_bytes));
    c->arena->fill_canary();
    c->ex = std::make_unique<Executor>(c->plan, "mlp", mlp_kernels::table, *c->arena, c->scalars);
    for (const Tensor &t : c->plan.tensors)
      if (t.role == Role::params || t.role == Role::adam_m || t.role == Role::adam_v)
        if (t.view_of < 0)
          for (float &x : c->ex->tensor<float>(t.name.view())) x = 0.01f * u(rng);
    for (float &x : c->ex->tensor<float>("inputs")) x = u(rng);
    for (auto &l : c->ex->tensor<std::int32_t>("labels")) l = int(rng() % mlp::classes);
    c->scalars.grad_scale = 1.f / batch;
    c->scalars.lr = 1e-4f;
    cases.push_back(std::move(c));
  }
  for (int r = 0; r <= rounds; ++r)
    for (auto &c : cases) {
      const auto t0 = std::chrono::steady_clock::now();
      c->ex->run(Executor::Phase::train);
      c->ex->run(Executor::Phase::optimize);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r == 0) c->measured_peak = c->arena->high_water();  // round 0 is warm-up
      else c->ms.push_back(ms);
    }
  auto median = [](std::vector<double> v) { std::ranges::sort(v); return v[v.size() / 2]; };
  const double base_ms = median(cases[0]->ms);
  const double base_act = double(cases[0]->plan.activation_bytes);
  fmt::print("MLP {} blocks, width {}, hidden {}, batch {}; median of {} interleaved steps (forward, backward, AdamW)\n",
             mlp::blocks, mlp::width, mlp::hidden, batch, rounds);
  fmt::print("{:<18} {:>9} {:>10} {:>14} {:>14} {:>12} {:>12} {:>10}\n", "policy", "step ms", "samples/s",
             "activations", "planned peak", "measured", "step/none", "act/none");
  for (auto &c : cases) {
    const double ms = median(c->ms);
    fmt::print("{:<18} {:>9.1f} {:>10.0f} {:>11.1f} MiB {:>10.1f} MiB {:>8.1f} MiB {:>12.2f} {:>10.3f}\n",
               policy_name(c->policy).view(), ms, batch * 1000.0 / ms, c->plan.activation_bytes / 1048576.0,
               c->plan.peak_bytes / 1048576.0, c->measured_peak / 1048576.0, ms / base_ms,
               c->plan.activation_bytes / base_act);
  }
  fmt::print("ratio step(full)/step(none) = {:.2f}\n", median(cases.back()->ms) / base_ms);
  return 0;
}
