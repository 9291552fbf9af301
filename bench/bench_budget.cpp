// The budget planner against the uniform policies: for the GPT and the Llama-style example, at
// activation budgets of 30%, 50% and 70% of the none plan's (the peak allowed: none's peak less
// the rest of its activation bytes), the step time of the budget plan (kernel costs measured
// here first, as --calibrate does) against the fastest uniform policy that fits the same peak
// (every_n_layers(n) for every n, sqrt_n, full, selective), interleaved round by round in one run.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>
import remat;
import remat.trainer;
import gpt;
import gpt.kernels;
import llama;
import llama.kernels;

using namespace remat;
using namespace remat::runtime;

namespace {

std::string cpu() {
  std::ifstream in("/proc/cpuinfo");
  std::string flags;
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("flags")) {
      for (const char *f : {"avx2", "avx512f", "avx512_bf16", "amx_tile"})
        if (line.find(std::string(" ") + f) != std::string::npos) flags += std::string(" ") + f;
      break;
    }
  return machine_name(Device::cpu) + " (" + flags.substr(flags.empty() ? 0 : 1) + ")";
}

struct Candidate {
  std::string name;
  std::unique_ptr<Engine> engine;
  std::vector<double> ms;
};

double median(std::vector<double> v) {
  std::ranges::sort(v);
  return v[v.size() / 2];
}

void bench(const ModelInfo &info, int rounds) {
  const Model &m = info.model;
  const int batch = info.defaults.batch;
  const Precision precision = Precision::fp32;
  std::unique_ptr<DataSource> data = data_source(info, {std::string(info.defaults.data_dir), batch, 1});
  const auto t0 = std::chrono::steady_clock::now();
  const CostModel costs = calibrate(info, Device::cpu, precision, batch, *data);
  const double calibrate_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const Plan none_plan = make_plan(m, none, batch, precision);
  std::vector<std::pair<std::string, Policy>> uniform = {
      {"none", none}, {"selective", selective}, {"sqrt_n", sqrt_n}, {"full", full}};
  for (int n = 2; n <= m.n_blocks(); ++n)
    uniform.push_back({fmt::format("every_n_layers={}", n), Policy{Policy::Kind::every_n_layers, n}});
  // the engines: every uniform policy once, and the budget plans
  std::map<std::string, std::unique_ptr<Candidate>> engines;
  auto engine_for = [&](const std::string &name, Plan plan) -> Candidate & {
    auto &c = engines[name];
    if (!c) {
      c = std::make_unique<Candidate>();
      c->name = name;
      c->engine = engine_for_timing(std::move(plan), info, Device::cpu, *data);
    }
    return *c;
  };
  struct Row {
    int percent;
    long long budget;
    std::string budget_name;
  };
  std::vector<Row> rows;
  for (int percent : {30, 50, 70}) {
    const long long budget =
        (long long)none_plan.peak_bytes - (long long)none_plan.activation_bytes * (100 - percent) / 100;
    Row row{percent, budget, fmt::format("budget {}%", percent)};
    for (const auto &[name, p] : uniform) {
      Plan plan = make_plan(m, p, batch, precision);
      if ((long long)plan.peak_bytes <= budget) engine_for(name, std::move(plan));
    }
    const Planned planned = plan_for(m, remat::budget(budget), batch, precision, costs);
    if (!planned.ok()) throw std::runtime_error(std::string(planned.error.view()));
    engine_for(row.budget_name, planned.plan);
    rows.push_back(row);
  }
  for (int r = 0; r <= rounds; ++r)
    for (auto &[name, c] : engines) {
      const auto s0 = std::chrono::steady_clock::now();
      c->engine->train();
      c->engine->optimize();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
      if (r > 0) c->ms.push_back(ms);
      if (r == 0 && c->engine->arena.high_water() != c->engine->plan.peak_bytes)
        throw std::runtime_error(fmt::format("{} {}: measured peak {} B, planned {} B", info.name, name,
                                             c->engine->arena.high_water(), c->engine->plan.peak_bytes));
    }
  fmt::print(
      "{}: batch {} ({} rows), fp32; none: peak {} B, activations {} B; kernel costs measured first ({:.1f} s); "
      "median of {} interleaved steps (forward, backward, AdamW)\n",
      info.name, batch, none_plan.rows, none_plan.peak_bytes, none_plan.activation_bytes, calibrate_s, rounds);
  fmt::print("{:<8} {:>12} {:>12} {:>10} {:>24} {:>10} {:>10} {:>8}\n", "act", "budget B", "plan peak", "budget ms",
             "best uniform that fits", "its ms", "its peak", "ratio");
  for (const Row &row : rows) {
    const Candidate &b = *engines.at(row.budget_name);
    const Candidate *best = nullptr;
    for (const auto &[name, p] : uniform) {
      auto it = engines.find(name);
      if (it == engines.end() || (long long)it->second->engine->plan.peak_bytes > row.budget) continue;
      if (!best || median(it->second->ms) < median(best->ms)) best = it->second.get();
    }
    const double bms = median(b.ms);
    if (!best) {
      fmt::print("{:<8} {:>12} {:>12} {:>10.1f} {:>24} {:>10} {:>10} {:>8}\n", fmt::format("{}%", row.percent),
                 row.budget, b.engine->plan.peak_bytes, bms, "(none fits)", "", "", "");
      continue;
    }
    fmt::print("{:<8} {:>12} {:>12} {:>10.1f} {:>24} {:>10.1f} {:>10} {:>8.3f}\n", fmt::format("{}%", row.percent),
               row.budget, b.engine->plan.peak_bytes, bms, best->name, median(best->ms), best->engine->plan.peak_bytes,
               bms / median(best->ms));
    fmt::print("ratio step(budget {}%)/step({}) = {:.3f}\n", row.percent, best->name, bms / median(best->ms));
  }
  for (const Row &row : rows) {
    fmt::print("budget {}% plan, kernel calls per block:\n", row.percent);
    const Plan &plan = engines.at(row.budget_name)->engine->plan;
    for (const Unit &u : units_of(m, head_fused(m, plan.policies)))
      fmt::print("  s{}.b{}: {}\n", u.stage, u.block, block_calls(plan, u));
  }
  fmt::print("\n");
}

// How long the dynamic program takes on a chain of 100 blocks (a 100-block residual MLP; no
// kernels run), at budgets between its smallest plan's peak and none's.
void solve_time() {
  const Model deep = check(make_model(input(64), linear(64, 128),
                                      repeat(100, residual(layer_norm(), linear(128, 512), gelu(), linear(512, 128))),
                                      layer_norm(), linear(128, 10), softmax_cross_entropy()))
                         .model;
  const int batch = 256;
  const Chain chain = chain_of(deep, batch, Precision::fp32);
  // offloading checkpoints as an option too (what the trainer gives the planner on a GPU)
  const Chain offloadable = chain_of(deep, batch, Precision::fp32, {.transfer_rate = 2e10});
  auto t0 = std::chrono::steady_clock::now();
  const BudgetSolution least = least_memory(chain);
  const double least_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const long long none_peak = (long long)make_plan(deep, none, batch, Precision::fp32).peak_bytes;
  fmt::print(
      "solve time, a chain of {} blocks ({} units with stem, head and loss): least_memory {:.1f} ms (peak {} B; none "
      "{} B)\n",
      deep.n_blocks(), chain.links.size(), least_ms, least.peak, none_peak);
  for (int percent : {25, 50, 75})
    for (const Chain *c : {&chain, &offloadable}) {
      const long long budget = least.peak + (none_peak - least.peak) * percent / 100;
      t0 = std::chrono::steady_clock::now();
      const BudgetSolution sol = fastest_within(*c, budget);
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      int offloaded = 0;
      for (const Decision &d : sol.strategy.table) offloaded += d.offload ? 1 : 0;
      fmt::print(
          "  budget {} B ({}% of the way to none){}: fastest_within {:.1f} ms, memory unit {} B ({} slots), feasible "
          "{}, "
          "predicted {:.1f} ms{}\n",
          budget, percent, c == &chain ? "" : ", offload an option", ms, sol.unit, (budget - c->persistent) / sol.unit,
          sol.feasible, sol.seconds * 1e3, c == &chain ? "" : fmt::format(", {} checkpoints offloaded", offloaded));
    }
}

}  // namespace

int main(int argc, char **argv) try {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 10;
  if (rounds < 1) {
    std::fprintf(stderr, "usage: bench-budget [ROUNDS >= 1]\n");
    return 2;
  }
  fmt::print("bench-budget on {}\n", cpu());
  solve_time();
  bench({"gpt", gpt::model, gpt::policy, gpt::trainer, gpt_kernels::table, gpt_kernels::cuda_table}, rounds);
  bench({"llama", llama::model, llama::policy, llama::trainer, llama_kernels::table, llama_kernels::cuda_table},
        rounds);
  return 0;
} catch (const std::exception &e) {
  std::fprintf(stderr, "bench-budget: %s\n", e.what());
  return 1;
}
