// module remat.planner: lowers (model, policy, batch, precision) to a schedule of kernel calls and
// a first-fit arena layout (make_plan), binding every argument of every kernel's signature. Its
// partitions (dsl/planner/): policies (what each stage asks for), strategy (how the chain runs, and
// the lowering of the fixed policies), plan (what a plan is), offload and builder (the step
// builder and its transfers), costs, memory and solver (the budget planner).
module;
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>
export module remat.planner;
export import remat.tensors;
export import :policies;
export import :strategy;
export import :plan;
export import :offload;
export import :builder;
export import :costs;
export import :memory;
export import :solver;

export namespace remat {

// A plan, or why there is none (an infeasible memory budget).
struct Planned {
  Plan plan;
  Message error;
  constexpr bool ok() const { return error.size() == 0; }
};

// The plan for one micro-batch of `batch` samples under each stage's policy (a single Policy:
// every stage's). Runs at compile time for a policy fixed in the model module and at run time
// for one chosen by a flag. A budget policy is solved by fastest_within with `costs`; if the
// arena's placement of that plan leaves holes that lift its peak past the budget, the budget is
// solved again that much smaller.
constexpr Plan plan_of(const Model &m, const StagePolicies &policies, const Strategy &st, int batch,
                       Precision precision) {
  detail::Builder builder{m, policies, st, batch, precision};
  builder.build();
  Plan plan = std::move(builder.plan);
  plan.policy = policies.stage[0];
  for (int s = m.n_stages - 1; s >= 0; --s)
    if (m.stages[s].checkpointable) plan.policy = policies.stage[s];
  plan.policy_label = policies_name(m, policies);
  return plan;
}

// Policy p for every stage, with the head of `as` (fused or not).
constexpr StagePolicies same_head(const Policy &p, const StagePolicies &as) {
  StagePolicies out(p);
  out.unfused_head = as.unfused_head;
  return out;
}

// The stages' policies with p's recompute schedule (their selective sets, offload and head kept).
constexpr StagePolicies with_schedule(StagePolicies ps, const Policy &p) {
  for (Policy &s : ps.stage) {
    s.kind = p.kind;
    s.n = p.n;
    s.budget_bytes = 0;
    s.budget_percent = 0;
  }
  return ps;
}

// The plan of least peak: least_memory's strategy, unless the arena's placement (first fit, which
// can leave holes of a few KiB) makes one of the fixed policies' smaller.
constexpr Plan smallest_plan(const Model &m, const StagePolicies &policies, int batch, Precision precision) {
  Plan best =
      plan_of(m, policies, least_memory(chain_of(m, batch, precision, {}, policies)).strategy, batch, precision);
  for (const Policy &p : {full, none, sqrt_n}) {
    Plan other = plan_of(m, policies, lower(m, same_head(p, policies)), batch, precision);
    if (other.peak_bytes < best.peak_bytes) best = std::move(other);
  }
  return best;
}
constexpr Plan smallest_plan(const Model &m, int batch, Precision precision = Precision::fp32) {
  return smallest_plan(m, StagePolicies{}, batch, precision);
}

constexpr Planned plan_for(const Model &m, const StagePolicies &policies, int batch,
                           Precision precision = Precision::fp32, const CostModel &costs = {}) {
  auto build = [&](const Strategy &st) { return plan_of(m, policies, st, batch, precision); };
  const Policy *budget = budget_of(m, policies);
  if (!budget) return {build(lower(m, policies)), {}};
  long long bytes = budget->budget_bytes;
  if (budget->budget_percent > 0)
    bytes = (long long)build(lower(m, same_head(none, policies))).peak_bytes * budget->budget_percent / 100;
  const Chain chain = chain_of(m, batch, precision, costs, policies);
  Plan smallest = smallest_plan(m, policies, batch, precision);
  // below the smallest plan that keeps its checkpoints on the device only offloading can fit
  if ((long long)smallest.peak_bytes > bytes && !chain.offloadable())
    return {{},
            cat<Message>("a memory budget of ", bytes, " bytes is infeasible at batch ", batch,
                         ": the smallest plan of this model needs ", (long long)smallest.peak_bytes, " bytes")};
  long long target = bytes;
  Plan found;
  bool have = false;
  double found_seconds = 0;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const BudgetSolution sol = fastest_within(chain, target);
    if (!sol.feasible) break;
    Plan plan = build(sol.strategy);
    if ((long long)plan.peak_bytes <= bytes) {
      found = std::move(plan), found_seconds = sol.seconds, have = true;
      break;
    }
    target -= (long long)plan.peak_bytes - bytes;
  }
  // The table rounds memory up near the budget, so it can miss the plans near it (and take one that
  // recomputes far more): a uniform schedule whose plan fits and is predicted faster is taken
  // instead, so a budget plan is never predicted slower than one.
  for (const Policy &p : {none, full, sqrt_n, every_n_layers(2), every_n_layers(3), every_n_layers(4)}) {
    const Strategy st = lower(m, with_schedule(policies, p));
    const double seconds = evaluate(chain, st, 0, chain.n()).seconds;
    if (have && seconds >= found_seconds) continue;
    Plan plan = build(st);
    if ((long long)plan.peak_bytes <= bytes) found = std::move(plan), found_seconds = seconds, have = true;
  }
  if (have) return {std::move(found), {}};
  if ((long long)smallest.peak_bytes > bytes)
    return {{},
            cat<Message>("a memory budget of ", bytes, " bytes is infeasible at batch ", batch,
                         ": the smallest plan of this model needs ", (long long)smallest.peak_bytes,
                         " bytes (offloading checkpoints did not fit either)")};
  return {std::move(smallest), {}};
}

constexpr Plan make_plan(const Model &m, const StagePolicies &policies, int batch,
                         Precision precision = Precision::fp32, const CostModel &costs = {}) {
  Planned p = plan_for(m, policies, batch, precision, costs);
  if (!p.ok()) throw "remat planner: the memory budget is infeasible (plan_for says by how much)";
  return std::move(p.plan);
}

// A model module's policy with a budget, checked where the model is built: an infeasible budget
// is a compile error that states the least feasible bytes.
// The model is a reference to the module's constexpr variable (its name, not its value, is what an
// error note prints).
template <const Model &M, Policy P, int Batch, Precision Pr = Precision::fp32>
consteval bool feasible() {
  constexpr Message error = plan_for(M, annotated(M, P), Batch, Pr).error;
  static_assert(error.size() == 0, cat<Message>("remat: ", error));
  return true;
}

}  // namespace remat
