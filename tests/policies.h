// The policies the tests run a model under: one list (policies_for), every suite's. Include after
// `import remat;`.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

namespace remat::testing {

// Every schedule a model module or the command line can ask for, alone and with offload (which
// goes with any policy; it moves nothing where nothing is checkpointed, so none has none).
inline std::vector<Policy> schedule_policies() {
  const Policy every_2{Policy::Kind::every_n_layers, 2};
  std::vector<Policy> out = {none, selective, full, every_2, sqrt_n};
  for (const Policy &p : {selective, full, every_2, sqrt_n}) out.push_back(with_offload(p));
  return out;
}

// ... and on model m its own annotations, over none and over selective.
inline std::vector<StagePolicies> fixed_policies(const Model &m) {
  std::vector<StagePolicies> out;
  for (const Policy &p : schedule_policies()) out.push_back(p);
  for (const StagePolicies &p : {annotated(m, none), annotated(m, selective)})
    if (std::ranges::find(out, p) == out.end()) out.push_back(p);
  return out;
}

// A policy case: the stages' policies and the costs the budget planner sees (a transfer rate: it may
// offload).
struct PolicyCase {
  StagePolicies policies;
  CostModel costs{};
  std::string label(const Model &m) const {
    return std::string(policies_name(m, policies).view()) + (costs.transfer_rate > 0 ? " (may offload)" : "");
  }
};

// fixed_policies, and budgets at `samples` in `precision`: the smallest plan's
// peak, and halfway from it to none's (the budget planner's strategies: nested recompute, blocks
// rebuilt twice, mixed keep / selective / checkpoint), that one again where offloading is an
// option (a GPU's transfer rate; the CPU runs the copies).
inline std::vector<PolicyCase> policies_for(const Model &m, int samples, Precision precision) {
  std::vector<PolicyCase> out;
  for (const StagePolicies &p : fixed_policies(m)) out.push_back({p});
  const long long least = (long long)smallest_plan(m, samples, precision).peak_bytes;
  const long long most = (long long)make_plan(m, none, samples, precision).peak_bytes;
  out.push_back({budget(least)});
  out.push_back({budget((least + most) / 2)});
  out.push_back({budget((least + most) / 2), CostModel{.transfer_rate = 2e10}});
  return out;
}

}  // namespace remat::testing
