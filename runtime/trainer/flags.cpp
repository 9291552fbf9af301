// The trainer's flags (CLI11), Hugging Face's names where they have one, and the policies they
// spell.
module;
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <optional>
#include <string>
#include <string_view>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace {

// Flag validators with short messages (CLI11's ranges print the whole double range).
CLI::Validator number(bool (*ok)(double), const char *what) {
  return CLI::Validator(
      [ok, what](std::string &text) -> std::string {
        try {
          std::size_t used = 0;
          const double v = std::stod(text, &used);
          if (used == text.size() && std::isfinite(v) && ok(v)) return {};
        } catch (const std::exception &) {}
        return fmt::format("'{}' is not {}", text, what);
      },
      what);
}
const CLI::Validator positive = number([](double v) { return v > 0; }, "a positive number");
const CLI::Validator non_negative = number([](double v) { return v >= 0; }, "a number >= 0");
const CLI::Validator probability = number([](double v) { return v >= 0 && v < 1; }, "a probability in [0, 1)");

}  // namespace

ParsedFlags parse_flags(int argc, char **argv, const ModelInfo &info, const std::string &program) {
  Options o;
  const TrainerDefaults &d = info.defaults;
  o.num_train_epochs = d.epochs;
  o.max_steps = d.max_steps;
  o.learning_rate = d.learning_rate;
  o.warmup_steps = d.warmup_steps;
  o.eval_samples = d.eval_samples;
  o.eval_steps = d.eval_steps;
  o.data_dir = d.data_dir;
  CLI::App app{fmt::format("Train the {} model with remat (checkpoint policies, AdamW).", info.name), program};
  app.add_option("--max-steps", o.max_steps, "optimizer steps (default: --num-train-epochs worth)")->check(positive);
  app.add_option("--num-train-epochs", o.num_train_epochs, "epochs when --max-steps is not given")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, fmt::format("samples per micro-batch (default {})", info.defaults.batch))
      ->check(positive);
  app.add_option("--gradient-accumulation-steps", o.gradient_accumulation_steps, "micro-batches per optimizer step")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--learning-rate", o.learning_rate, "peak AdamW learning rate")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay on linear weights")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--lr-scheduler-type", o.lr_scheduler_type, "learning-rate schedule after warm-up")
      ->check(CLI::IsMember({"constant", "cosine"}))
      ->capture_default_str();
  app.add_option("--warmup-steps", o.warmup_steps, "linear warm-up steps")->check(non_negative)->capture_default_str();
  app.add_option("--seed", o.seed, "seed for initialization, shuffling and dropout")
      ->check(number([](double v) { return v >= 0 && v == std::floor(v); }, "a whole number >= 0"))
      ->capture_default_str();
  app.add_option(
      "--checkpoint-policy", o.checkpoint_policy,
      fmt::format("none | full | every_n_layers=N | sqrt_n | selective, composed with + (every_n_layers=2+selective); "
                  "per repeat stage s<i>:POLICY,... (default: the model's, {})",
                  policies_name(info.model, annotated(info.model, info.default_policy)).view()));
  app.add_option(
      "--memory-budget", o.memory_budget,
      "the fastest plan whose peak fits SIZE (512MiB, 2GB, 1000000) or a percentage of the none plan's peak (60%)");
  app.add_flag("--calibrate", o.calibrate,
               "time every kernel here first and store the costs in the cost table, for the budget planner");
  app.add_option("--cost-table", o.cost_table, fmt::format("the kernel cost table (default {})", default_cost_table()));
  app.add_flag("--sweep", o.sweep,
               "with --plan-report: the budget -> step time table from the smallest plan to none, and its plot");
  app.add_option("--dropout", o.dropout, "dropout probability of the model's dropout layers and attention")
      ->check(probability)
      ->capture_default_str();
  app.add_option("--data-dir", o.data_dir, "dataset folder")->capture_default_str();
  app.add_option("--eval-samples", o.eval_samples, "evaluation samples (default all, 0 skips evaluation)")
      ->check(non_negative);
  app.add_option("--eval-steps", o.eval_steps, "also evaluate every N steps (0: only at the end)")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--logging-steps", o.logging_steps, "print progress every N steps")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--save-snapshot", o.save_snapshot,
                 "write a snapshot (weights, optimizer, step, data state) here at the end");
  app.add_option("--save-steps", o.save_steps, "also write a snapshot every N steps, to FILE.step<N>")->check(positive);
  app.add_option("--resume-from-snapshot", o.resume_from_snapshot, "continue a run from its snapshot (same flags)");
  app.add_option("--save-initial", o.save_initial,
                 "write the parameters and the first (micro-)batch, before the first step, as safetensors");
  app.add_option("--device", o.device, "where kernels run: cpu, or cuda (device 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_flag("--bf16", o.bf16,
               "bf16 activations and GEMM operands (fp32 accumulation), fp32 master weights and AdamW");
  app.add_flag("--offload", o.offload,
               "keep checkpoints in pinned host memory between forward and backward (--device cuda)");
  app.add_flag("--json", o.json, "print a JSON summary as the last line of stdout (progress goes to stderr)");
  app.add_flag("--plan-report", o.plan_report, "print every tensor saved for backward under the policy, then exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp &e) { return {o, app.exit(e)}; } catch (const CLI::ParseError &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return {o, 2};
  }
  return {o, std::nullopt};
}

Policy parse_policy(std::string_view text) {
  Policy out;
  std::string_view rest = text;
  while (true) {
    const std::size_t plus = rest.find('+');
    const std::string_view part = rest.substr(0, plus);
    constexpr std::string_view every = "every_n_layers=";
    Policy p;
    if (part == "none")
      p = none;
    else if (part == "full")
      p = full;
    else if (part == "sqrt_n")
      p = sqrt_n;
    else if (part == "selective")
      p = selective;
    else if (part == "offload")
      p = offload;
    else if (part.starts_with(every)) {
      int n = 0;
      const auto digits = part.substr(every.size());
      const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
      if (digits.empty() || err != std::errc() || end != digits.data() + digits.size() || n < 1)
        throw InputError(fmt::format("--checkpoint-policy {}: every_n_layers needs a whole number N >= 1", text));
      p = Policy{Policy::Kind::every_n_layers, n};
    } else {
      throw InputError(
          fmt::format("--checkpoint-policy {}: unknown policy {} (use none, full, every_n_layers=N, sqrt_n, "
                      "selective or offload, composed with +)",
                      text, part));
    }
    if (const std::string_view why = composition_error(out, p); !why.empty())
      throw InputError(fmt::format("--checkpoint-policy {}: {}", text, why));
    out = out | p;
    if (plus == std::string_view::npos) break;
    rest = rest.substr(plus + 1);
  }
  return out;
}

StagePolicies parse_stage_policies(const Model &model, std::string_view text, StagePolicies base) {
  if (text.find(':') == std::string_view::npos) {
    StagePolicies every(parse_policy(text));
    // a stage's selective set (and what it offloads) is fixed in its kernels: the annotation's
    for (int s = 0; s < model.n_stages; ++s) every.stage[s].selection = model.stages[s].policy.selection;
    return every;
  }
  std::string repeat_stages;
  for (int s = 0; s < model.n_stages; ++s)
    if (model.stages[s].checkpointable) repeat_stages += fmt::format("{}s{}", repeat_stages.empty() ? "" : ", ", s);
  std::string_view rest = text;
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    const std::size_t colon = item.find(':');
    int stage = -1;
    if (colon != std::string_view::npos && item.starts_with('s')) {
      const auto [end, err] = std::from_chars(item.data() + 1, item.data() + colon, stage);
      if (err != std::errc() || end != item.data() + colon) stage = -1;
    }
    if (stage < 0 || stage >= model.n_stages || !model.stages[stage].checkpointable)
      throw InputError(
          fmt::format("--checkpoint-policy {}: {} names no repeat stage (per stage: s<i>:POLICY,... with i one of {})",
                      text, item, repeat_stages.empty() ? "none: the model has no repeat stage" : repeat_stages));
    Policy p = parse_policy(item.substr(colon + 1));
    // a stage's selective set is fixed in its kernels: the annotation's
    p.selection = model.stages[stage].policy.selection;
    base.stage[stage] = p;
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  return base;
}

Policy parse_budget(std::string_view text) {
  auto bad = [&] {
    return InputError(
        fmt::format("--memory-budget {}: expected bytes with an optional unit (512MiB, 2GB, 1000000) or a "
                    "percentage of the none plan's peak (60%)",
                    text));
  };
  double value = 0;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (err != std::errc() || !(value > 0)) throw bad();
  std::string unit(end, text.data() + text.size());
  std::ranges::transform(unit, unit.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (unit == "%") {
    if (value > 100 || value != std::floor(value)) throw bad();
    return budget_percent(int(value));
  }
  const std::map<std::string, double> units = {
      {"", 1},       {"b", 1},         {"kb", 1e3},        {"mb", 1e6},
      {"gb", 1e9},   {"kib", 1024.0},  {"mib", 1048576.0}, {"gib", 1073741824.0},
      {"k", 1024.0}, {"m", 1048576.0}, {"g", 1073741824.0}};
  const auto u = units.find(unit);
  if (u == units.end() || value * u->second < 1 || value * u->second > 9e18) throw bad();
  return budget((long long)(value * u->second));
}

}  // namespace remat::runtime
