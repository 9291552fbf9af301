// What a training run reports at its end: the memory (planned and measured peak, activations
// against none's) and speed lines, and with --json one line of JSON as the last of stdout.
module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {

std::string mib(std::size_t bytes) { return fmt::format("{:.1f} MiB", bytes / 1048576.0); }

void print_summary(const Options &o, const ModelInfo &info, const Run &run, const Summary &s) {
  const Plan &plan = run.plan;
  std::vector<double> sorted = s.step_ms;
  std::ranges::sort(sorted);
  const double median = sorted.empty() ? 0 : sorted[sorted.size() / 2];  // every step skipped: none
  const int ranks = Ranks::world().size;
  const double samples_per_s = double(s.step_ms.size()) * run.batch * run.micro * ranks / s.train_seconds;
  const double rows_per_s = samples_per_s * info.model.rows_per_sample();
  fmt::print(
      o.json ? stderr : stdout,
      "memory: planned peak {} B, measured peak {} B{} ({}); activations {} under {} vs {} under none ({:.1f}%)\n"
      "speed: {:.0f} samples/s ({:.0f} rows/s), median step {:.1f} ms, {} kernel launches per micro-batch ({} "
      "recompute)\n",
      plan.peak_bytes, s.measured_peak, ranks > 1 ? fmt::format(" (the largest of {} ranks)", ranks) : "",
      s.measured_peak == plan.peak_bytes ? "equal" : "DIFFERENT", mib(plan.activation_bytes), run.policy_label,
      mib(s.activation_bytes_none), 100.0 * plan.activation_bytes / s.activation_bytes_none, samples_per_s, rows_per_s,
      median, plan.total_launches, plan.recompute_launches);
  // data-parallel: the gradient all-reduce (the communication thread's MPI ring, or NCCL's on the
  // GPU), and how much of it the end of backward waited for
  double allreduce_ms = 0, waited_ms = 0;  // per step
  for (const GradientReducer::Times &t : s.allreduce) {
    allreduce_ms += t.busy_ms / double(s.allreduce.size());
    waited_ms += t.wait_ms / double(s.allreduce.size());
  }
  const double hidden = allreduce_ms > 0 ? std::max(0.0, 1 - waited_ms / allreduce_ms) : 0;
  if (!s.allreduce.empty())
    fmt::print(o.json ? stderr : stdout,
               "all-reduce ({}): {:.1f} ms per step, {:.1f} ms waited after backward ({:.0f}% hidden){}\n",
               s.collectives, allreduce_ms, waited_ms, 100 * hidden,
               s.collectives_device_bytes > 0 ? fmt::format("; {} B ({}) of device memory outside the arena",
                                                            s.collectives_device_bytes, mib(s.collectives_device_bytes))
                                              : "");
  if (!o.json) return;
  auto optional = [&](auto f) { return s.eval ? nlohmann::json(f(*s.eval)) : nlohmann::json(); };
  const nlohmann::json j = {
      {"model", std::string(info.name)},
      {"policy", run.policy_label},
      {"device", o.device},
      {"precision", std::string(precision_name(run.precision))},
      {"offload_bytes", plan.offload_bytes},
      {"batch_size", run.batch},  // per rank
      {"ranks", ranks},
      {"gradient_accumulation_steps", run.micro},
      {"dropout", o.dropout},
      {"steps", s.last_step},
      {"loss_first", s.loss_first},
      {"loss_last", s.loss_last},
      {"eval_accuracy", optional([](const Evaluation &e) { return e.accuracy; })},
      {"eval_loss", optional([](const Evaluation &e) { return e.loss; })},
      {"val_loss", optional([](const Evaluation &e) { return e.loss; })},
      {"samples_per_s", samples_per_s},
      {"tokens_per_s", rows_per_s},
      {"step_ms_median", median},
      {"allreduce_ms_mean", allreduce_ms},
      {"allreduce_wait_ms_mean", waited_ms},
      {"allreduce_hidden", hidden},
      {"collectives", s.collectives},
      {"collectives_device_bytes", s.collectives_device_bytes},
      {"step_ms", s.step_ms},
      {"planned_peak_bytes", plan.peak_bytes},
      {"measured_peak_bytes", s.measured_peak},
      {"halide_heap_peak_bytes", halide_heap().peak},
      {"step_heap_allocations", step_heap().allocations},
      {"step_heap_bytes", step_heap().bytes},
      {"activation_bytes", plan.activation_bytes},
      {"activation_bytes_none", s.activation_bytes_none},
      {"kernel_costs", run.costs_from},
      {"param_count", plan.param_count},
      {"kernel_launches", plan.total_launches},
      {"recompute_launches", plan.recompute_launches},
      {"grad_digest", s.grad_digest},
      {"param_digest", s.param_digest},
  };
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);  // the summary is out even if teardown fails later
}

}  // namespace remat::runtime
