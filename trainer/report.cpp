// The plan report (--plan-report): what each block's kernels do, every tensor saved for backward
// and why, the peak, the recompute arithmetic and the predicted step time; with --sweep, the
// budget -> step time table (printed, and as JSON for scripts/plot.py).
module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <ostream>
#include <set>
#include <string>
#include <string_view>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {

namespace {
// The fused head's line: its chunks, and the peak the same plan has with the head run whole.
void print_head(std::FILE *out, const Model &model, const Plan &plan, const CostModel &costs) {
  const int s = head_stage(model);
  const std::vector<RowRange> chunks = head_chunks(model, plan.batch, plan.precision);
  long long most = 0;
  for (const RowRange &r : chunks) most = std::max(most, r.rows);
  StagePolicies unfused = plan.policies;
  unfused.unfused_head = true;
  const Planned whole = plan_for(model, unfused, plan.batch, plan.precision, costs);
  const std::size_t logits =
      std::size_t(plan.rows) * model.classes() * element_bytes(activation_element(plan.precision));
  fmt::print(out, "s{}.b0    fused head: {} chunks of up to {} rows, each: forward_save, loss, backward_saved\n", s,
             chunks.size(), most);
  if (whole.ok())
    fmt::print(out,
               "         the [{}, {}] logits ({}) and their gradient are never whole: planned peak {} B, {} B with "
               "the head unfused (+unfused_head), {} B less\n",
               plan.rows, model.classes(), mib(logits), plan.peak_bytes, whole.plan.peak_bytes,
               (long long)whole.plan.peak_bytes - (long long)plan.peak_bytes);
}
}  // namespace

namespace {
// Why tensor t (x) of the plan lives from its forward to a backward: a block's input (a
// checkpoint or not) or a layer's output or statistics.
std::string why_saved(const Model &model, const Plan &plan, const Tensor &x, int t, const std::set<int> &fetched,
                      int head) {
  const Block &blk = model.stages[x.key.stage];
  std::string why;
  if (x.role == Role::block_input) {  // a block's output: the input of the next block
    const bool last_of_stage = x.key.block + 1 == blk.repeat;
    const int stage = last_of_stage ? x.key.stage + 1 : x.key.stage, block = last_of_stage ? 0 : x.key.block + 1;
    bool checkpoint = false;
    for (const Step &st : plan.train)
      checkpoint |= st.stage == stage && st.block == block && st.variant == Variant::backward_recompute;
    why = checkpoint ? fmt::format("checkpoint: input of s{}.b{}, whose backward recomputes from it", stage, block)
                     : fmt::format("input of s{}.b{}, read by its backward", stage, block);
  } else if (x.key.layer >= 0) {
    const Layer &l = blk.layers[x.key.layer];
    if (x.kind == LocalTensor::Kind::statistic)
      why = fmt::format("{} row statistics, read by its backward", op_name(l.op));
    else
      why = fmt::format("{} output, read by the backward of {} (layer {})", op_name(l.op),
                        op_name(blk.layers[x.read_by].op), x.read_by);
  }
  if (fetched.contains(t)) why += "; waits in pinned host memory between forward and backward (offload)";
  if (x.key.stage == head) why += "; a fused head's chunk: one chunk's rows at a time";
  return why;
}

// The tensors saved for backward (living past the kernel that wrote it until a backward kernel
// reads it), one line each; their total bytes.
std::size_t print_saved(std::FILE *out, const Model &model, const Plan &plan, const std::set<int> &fetched) {
  fmt::print(out, "saved for backward:\n");
  fmt::print(out, "{:<8} {:<22} {:>16} {:>12}  {}\n", "block", "tensor", "shape", "bytes", "why");
  std::size_t total = 0;
  std::set<TensorKey> listed;  // a fused head's chunks keep the same tensors: listed once, per chunk
  const int head = head_fused(model, plan.policies) ? head_stage(model) : -1;
  for (const Step &st : plan.train)
    for (int t : st.alloc) {
      const Tensor &x = plan.tensors[t];
      if (x.role != Role::internal && x.role != Role::block_input) continue;
      if (x.key.stage == head && !listed.insert(x.key).second) continue;
      bool read_by_backward = false;
      for (const Step &later : plan.train)
        if (is_backward(later.variant))
          for (const Arg &a : later.args) read_by_backward |= a.tensor == t;
      if (!read_by_backward) continue;
      const std::string shape =
          x.dims == 1 ? fmt::format("[{}]", x.extent[0]) : fmt::format("[{}, {}]", x.extent[1], x.extent[0]);
      fmt::print(out, "s{}.b{:<4} {:<22} {:>16} {:>12}  {}\n", x.key.stage, x.key.block, name_of(x.key.local()).view(),
                 shape, x.bytes(), why_saved(model, plan, x, t, fetched, head));
      total += x.bytes();
    }
  return total;
}

// Data parallel, per rank: the AdamW moments (sharded or not) and how gradients are exchanged.
void print_ranks(std::FILE *out, const Plan &plan) {
  std::size_t exchange = 0;
  for (const Tensor &t : plan.tensors)
    if (t.role == Role::exchange) exchange += t.bytes();
  const std::size_t moments = 2 * plan.tensors[plan.adam_m().index].bytes();
  fmt::print(
      out, "data-parallel, per rank of {}: AdamW moments {} B ({}{}), {}\n", plan.policies.ranks, moments, mib(moments),
      plan.policies.shard_optimizer
          ? fmt::format(", the shard of slots [{}, {}): --shard-optimizer", plan.shard_first, plan.shard_end)
          : ", every parameter's",
      plan.policies.exchange_buffer ? fmt::format("gradient exchange buffer {} B ({})", exchange, mib(exchange))
                                    : "gradients summed in place by NCCL (its own buffers are outside the arena)");
}
}  // namespace

void print_plan_report(std::FILE *out, const Model &model, const Plan &plan, const CostModel &costs,
                       std::string_view costs_from) {
  fmt::print(out, "plan under policy {} ({}, batch {}, {} rows)\n", plan.policy_label.view(),
             precision_name(plan.precision), plan.batch, plan.rows);
  // each block's kernel calls in schedule order; * marks a call that recomputes forward work
  fmt::print(out, "{:<8} {}\n", "block", "kernel calls in schedule order (* recomputes forward work)");
  for (const Unit &u : units_of(model, head_fused(model, plan.policies)))
    fmt::print(out, "s{}.b{:<4} {}\n", u.stage, u.block, block_calls(plan, u));
  if (head_fused(model, plan.policies)) print_head(out, model, plan, costs);
  std::set<int> fetched;  // restored copies of offloaded tensors
  for (const Step &st : plan.train)
    for (auto [host, into] : st.fetch) fetched.insert(into);
  const std::size_t total = print_saved(out, model, plan, fetched);
  double flops = 0, recompute_flops = 0;
  for (const Step &st : plan.train) {
    flops += st.flops;
    if (!st.recompute) continue;
    recompute_flops += is_backward(st.variant)
                           ? st.flops - kernel_flops(model.stages[st.stage], Variant::backward_saved, plan.rows)
                           : st.flops;
  }
  const Chain chain = chain_of(model, plan.batch, plan.precision, costs, plan.policies);
  const Outcome predicted = evaluate(chain, plan.strategy, 0, chain.n());
  fmt::print(
      out,
      "total saved {} B ({}); peak activations {} B; planned arena peak {} B ({}); {} kernel launches ({} recompute)\n",
      total, mib(total), plan.activation_bytes, plan.peak_bytes, mib(plan.peak_bytes), plan.total_launches,
      plan.recompute_launches);
  if (plan.offload_bytes > 0)
    fmt::print(out, "offloaded {} tensors to {} B ({}) of pinned host memory\n", fetched.size(), plan.offload_bytes,
               mib(plan.offload_bytes));
  if (plan.policies.ranks > 1) print_ranks(out, plan);
  fmt::print(
      out,
      "recompute {:.3f} GFLOP of {:.3f} per micro-batch; predicted forward + loss + backward {:.2f} ms (costs {})\n",
      recompute_flops / 1e9, flops / 1e9, predicted.seconds * 1e3, costs_from);
}

// The budget -> step time table, from the smallest plan to none's peak, printed and written as JSON.
void print_sweep(std::FILE *out, const ModelInfo &info, const Run &run, const Options &o, const std::string &program) {
  const Model &m = info.model;
  const Device device = run.device;
  const Precision precision = run.precision;
  const int batch = run.batch;
  const CostModel &costs = run.costs;
  const Chain chain = chain_of(m, batch, precision, costs);
  const long long lo = (long long)smallest_plan(m, batch, precision).peak_bytes;
  const long long hi = (long long)make_plan(m, none, batch, precision).peak_bytes;
  std::unique_ptr<DataSource> data;
  if (o.calibrate) data = data_source(info, data_options(o, batch));
  struct Row {
    long long budget, peak;
    double predicted, measured;
    int launches, recompute;
  };
  std::vector<Row> rows;
  const int points = 9;
  for (int i = 0; i < points; ++i) {
    const long long b = lo + (hi - lo) * i / (points - 1);
    const Planned p = plan_for(m, budget(b), batch, precision, costs);
    if (!p.ok()) continue;
    const double predicted = evaluate(chain, p.plan.strategy, 0, chain.n()).seconds * 1e3;
    const double measured = data ? measured_step_ms(p.plan, info, device, *data) : 0;
    rows.push_back(
        {b, (long long)p.plan.peak_bytes, predicted, measured, p.plan.total_launches, p.plan.recompute_launches});
  }
  fmt::print(out, "\nbudget sweep ({} to none's peak {} B):\n{:>14} {:>8} {:>14} {:>13} {:>12} {:>9}\n", lo, hi,
             "budget B", "% none", "planned peak", "predicted ms", o.calibrate ? "measured ms" : "", "launches");
  for (const Row &r : rows)
    fmt::print(out, "{:>14} {:>7.1f}% {:>14} {:>13.2f} {:>12} {:>4} ({} re)\n", r.budget, 100.0 * r.budget / hi, r.peak,
               r.predicted, o.calibrate ? fmt::format("{:.2f}", r.measured) : "", r.launches, r.recompute);
  // the table as JSON, for scripts/plot.py sweep
  nlohmann::json table = {{"model", std::string(info.name)},
                          {"precision", std::string(precision_name(precision))},
                          {"batch", batch},
                          {"device", o.device},
                          {"none_peak_bytes", hi},
                          {"measured", o.calibrate},
                          {"rows", nlohmann::json::array()}};
  for (const Row &r : rows)
    table["rows"].push_back({{"budget_bytes", r.budget},
                             {"planned_peak_bytes", r.peak},
                             {"predicted_ms", r.predicted},
                             {"measured_ms", o.calibrate ? nlohmann::json(r.measured) : nlohmann::json()},
                             {"launches", r.launches},
                             {"recompute_launches", r.recompute}});
  const std::string path = program + "-sweep.json";
  write_atomically(path, "sweep table", [&](std::ostream &json) { json << table.dump(1) << '\n'; });
  fmt::print(out, "table: {} (plot: .venv/bin/python scripts/plot.py sweep {} -o {}-sweep.png)\n", path, path, program);
}

}  // namespace remat::runtime
