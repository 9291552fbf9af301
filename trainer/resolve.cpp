// What the flags resolve to: each stage's policy (the model's annotations, --checkpoint-policy or a
// --memory-budget), the device and precision, the batch, the kernel costs the budget planner uses
// (measured now, from the cost table, or estimated) and the plan. Every contradiction is one line.
module;
#include "cuda_device.h"

#include <fmt/format.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace {

// What the budget planner assumes of copies between a GPU and pinned host memory, each way: a
// PCIe 4/5 x16 link sustains 20-50 GB/s; the low end, so that offload is not chosen on optimism.
constexpr double cuda_host_transfer_rate = 2e10;

bool has_dropout(const Model &m) {  // dropout layers, or attention (dropout on its probabilities)
  for (int s = 0; s < m.n_stages; ++s)
    for (int k = 0; k < m.stages[s].n_layers; ++k)
      if (kind(m.stages[s].layers[k].op).draws_masks) return true;
  return false;
}

// Each stage's policy: the model's (its annotations over its default), --checkpoint-policy over it,
// or the budget; --offload on every stage. On the CPU the arena is host memory: what a policy
// offloads stays in it.
StagePolicies resolve_policies(const Options &o, const ModelInfo &info, Device device) {
  const Model &model = info.model;
  StagePolicies policies = annotated(model, info.default_policy);
  if (!o.checkpoint_policy.empty()) policies = parse_stage_policies(model, o.checkpoint_policy, policies);
  // (--memory-budget with --checkpoint-policy is refused with the flags: flags.cpp)
  if (!o.memory_budget.empty()) policies = parse_budget(o.memory_budget);
  if (o.offload && device == Device::cpu)
    throw InputError(
        "--offload: with --device cpu the checkpoints already live in host memory; there is nothing to offload");
  if (o.offload && !o.memory_budget.empty())
    throw InputError("--offload: with --memory-budget the budget planner decides which checkpoints to offload");
  for (Policy &p : policies.stage) {
    p.offload = p.offload || o.offload;
    if (device == Device::cpu) {
      p.offload = false;
      p.selection.offloaded = 0;
    }
  }
  return policies;
}

// The kernel costs: measured now (--calibrate, and stored in the cost table), read from the table,
// or estimated; a GPU's planner may offload checkpoints to pinned host memory.
void resolve_costs(const Options &o, const ModelInfo &info, const std::string &program, Run &run) {
  const std::string cost_table = o.cost_table.empty() ? default_cost_table() : o.cost_table;
  const std::string machine = machine_name(run.device), key = cost_key(info.name, run.precision, run.batch, run.device);
  run.costs_from = "estimated from FLOPs and bytes (no --calibrate table for this machine)";
  if (o.calibrate) {
    if (run.device == Device::cuda) check_cuda(info, 0);
    std::unique_ptr<DataSource> data = data_source(info, data_options(o, run.batch));
    run.costs = calibrate(info, run.device, run.precision, run.batch, *data);
    if (Ranks::world().rank == 0) save_costs(cost_table, machine, key, run.costs);  // ranks share a machine's table
    run.costs_from = fmt::format("measured now on {} ({}, {})", machine, cost_table, key);
    fmt::print(o.json ? stderr : stdout, "{}: calibrated {} kernels on {}; written to {} as {}\n", program,
               run.costs.measured.size(), machine, cost_table, key);
  } else if (std::optional<CostModel> stored = load_costs(cost_table, machine, key)) {
    run.costs = *stored;
    run.costs_from = fmt::format("measured on {} ({}, {})", machine, cost_table, key);
  }
  if (run.device == Device::cuda) run.costs.transfer_rate = cuda_host_transfer_rate;
}

void check_snapshot_flags(const Options &o) {
  if (!o.removed_save_snapshot.empty())
    throw InputError("--save-snapshot FILE: snapshots are folders now; use --output-dir DIR (README: Snapshots)");
  if (o.output_dir.empty() && (o.save_steps || o.save_total_limit))
    throw InputError(fmt::format("{} needs --output-dir DIR", o.save_steps ? "--save-steps" : "--save-total-limit"));
  if (!o.init_from.empty() && !o.resume_from_snapshot.empty())
    throw InputError("--init-from and --resume-from-snapshot: a resumed run has its weights already; pass one");
}

}  // namespace

Run resolve(const Options &o, const ModelInfo &info, const std::string &program) {
  const Model &model = info.model;
  Run run;
  run.device = o.device == "cuda" ? Device::cuda : Device::cpu;
  const Ranks &ranks = Ranks::world();
  if (run.device == Device::cuda) cuda::select_device(ranks.local_rank);  // one GPU per rank on a machine
  run.policies = resolve_policies(o, info, run.device);
  run.policies.ranks = ranks.size;
  run.policies.rank = ranks.rank;
  run.policies.exchange_buffer = run.device == Device::cpu;  // the MPI ring's; NCCL sums in place
  run.policies.shard_optimizer = o.shard_optimizer;
  run.batch = o.batch_size ? o.batch_size : info.defaults.batch;
  run.micro = o.gradient_accumulation_steps;
  if (long(run.batch) * model.rows_per_sample() < min_kernel_rows)
    throw InputError(
        fmt::format("--batch-size {}: the kernels need at least {} rows per micro-batch", run.batch, min_kernel_rows));
  if (o.dropout > 0 && !has_dropout(model))
    throw InputError(fmt::format("--dropout {}: model {} has no dropout layers", o.dropout, info.name));
  if (o.sweep && !o.plan_report) throw InputError("--sweep: goes with --plan-report");
  check_snapshot_flags(o);
  run.precision = o.bf16 ? Precision::bf16 : Precision::fp32;
  resolve_costs(o, info, program, run);
  Planned planned = plan_for(model, run.policies, run.batch, run.precision, run.costs);
  if (!planned.ok())
    throw InputError(
        o.memory_budget.empty()
            ? fmt::format("the model's policy {}: {}", policies_name(model, run.policies).view(), planned.error.view())
            : fmt::format("--memory-budget {}: {}", o.memory_budget, planned.error.view()));
  run.plan = std::move(planned.plan);
  run.policy_label = std::string(run.plan.policy_label.view());
  for (const Tensor &t : run.plan.tensors)
    if (t.bytes() > std::size_t(INT32_MAX))
      throw InputError(
          fmt::format("--batch-size {}: tensor {} would hold {} bytes; kernels take at most 2 GiB per tensor",
                      run.batch, name_of(t.key).view(), t.bytes()));
  if (o.offload && run.plan.offload_bytes == 0)
    throw InputError(fmt::format("--offload: policy {} keeps no checkpoints (use full, every_n_layers=N or sqrt_n)",
                                 run.policy_label));
  return run;
}

}  // namespace remat::runtime
