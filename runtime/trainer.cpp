module;
#include "cuda_device.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace {

struct Options {
  long max_steps = 0;  // 0: derived from num_train_epochs
  int num_train_epochs = 0;
  int batch_size = 0;
  int gradient_accumulation_steps = 1;
  double learning_rate = 0;
  double weight_decay = 0.01;
  std::string lr_scheduler_type = "cosine";
  int warmup_steps = 0;
  std::uint64_t seed = 42;
  std::string checkpoint_policy;
  std::string memory_budget;
  bool calibrate = false;
  std::string cost_table;
  bool sweep = false;
  double dropout = 0;
  std::string data_dir;
  int eval_samples = -1;
  int eval_steps = 0;
  int logging_steps = 50;
  bool json = false;
  bool plan_report = false;
  std::string save_snapshot, resume_from_snapshot, save_initial;
  long save_steps = 0;
  std::string device = "cpu";
  bool offload = false;
  bool bf16 = false;
};

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
// What the budget planner assumes of copies between a GPU and pinned host memory, each way: a
// PCIe 4/5 x16 link sustains 20-50 GB/s; the low end, so that offload is not chosen on optimism.
constexpr double cuda_host_transfer_rate = 2e10;

const CLI::Validator positive = number([](double v) { return v > 0; }, "a positive number");
const CLI::Validator non_negative = number([](double v) { return v >= 0; }, "a number >= 0");
const CLI::Validator probability = number([](double v) { return v >= 0 && v < 1; }, "a probability in [0, 1)");

// Deterministic uniform in [-1, 1) from a 64-bit generator (the same on every platform).
double learning_rate(const Options &o, long step, long max_steps) {  // step counts from 1
  if (step <= o.warmup_steps) return o.learning_rate * step / std::max(1, o.warmup_steps);
  if (o.lr_scheduler_type == "constant") return o.learning_rate;
  // progress 0 on the first step after warm-up, below 1 on the last step (which still learns)
  const double progress = double(step - o.warmup_steps - 1) / std::max(1L, max_steps - o.warmup_steps);
  return o.learning_rate * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

bool has_dropout(const Model &m) {  // dropout layers, or attention (dropout on its probabilities)
  for (int s = 0; s < m.n_stages; ++s)
    for (int k = 0; k < m.stages[s].n_layers; ++k)
      if (kind(m.stages[s].layers[k].op).draws_masks) return true;
  return false;
}

struct Evaluation {
  double loss = 0, accuracy = 0;
  long samples = 0;
};

// Forward-discard over `samples` evaluation samples (dropout off).
Evaluation evaluate(DataSource &data, Executor &ex, Scalars &scalars, const Plan &plan, long samples, double dropout) {
  Evaluation e;
  e.samples = std::min(samples, data.eval_samples());
  if (e.samples == 0) throw InputError("the evaluation split is empty (pass --eval-samples 0 to skip evaluation)");
  const long rows_per_sample = plan.rows / plan.batch;
  double loss_sum = 0;
  long correct = 0;
  scalars.set_dropout(0);
  for (long first = 0; first < e.samples; first += plan.batch) {
    data.load_eval_batch(ex, first);
    ex.run(Executor::Phase::eval);
    ex.download(plan.row_loss());
    ex.download(plan.row_correct());
    const auto l = ex.tensor<float>(plan.row_loss());
    const auto c = ex.tensor<std::int32_t>(plan.row_correct());
    const long rows = std::min<long>(plan.batch, e.samples - first) * rows_per_sample;
    for (long r = 0; r < rows; ++r) {
      loss_sum += l[r];
      correct += c[r];
    }
  }
  scalars.set_dropout(dropout);
  e.loss = loss_sum / double(e.samples * rows_per_sample);
  e.accuracy = double(correct) / double(e.samples * rows_per_sample);
  return e;
}

// Autoregressive sampling from a token model: a plan for one sequence, the trained parameters,
// and the logits of the last filled position, at temperature 0.8.
std::string generate(const ModelInfo &info, Device device, Precision precision, Executor &trained, int length,
                     std::uint64_t seed) {
  const Model &model = info.model;
  const int T = model.input.block_size, V = model.classes();
  const int samples = (min_kernel_rows + T - 1) / T;  // the sequence is sample 0; the rest pad the batch
  Engine engine(make_plan(model, none, samples, precision, gemms_of(device, precision)), info.name,
                device == Device::cuda ? info.cuda_kernels : info.kernels, {.device = device, .canary = false});
  Executor &ex = engine.executor;
  trained.download(trained.plan.params());
  std::ranges::copy(trained.tensor<float>(trained.plan.params()), ex.tensor<float>(engine.plan.params()).begin());
  ex.upload(engine.plan.params());
  const TensorId logits = engine.plan.logits(Phase::eval);
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> text = {'\n'};
  std::string out;
  auto inputs = ex.tensor<std::int32_t>(engine.plan.inputs());
  for (int i = 0; i < length; ++i) {
    const int n = std::min<int>(int(text.size()), T);
    std::fill(inputs.begin(), inputs.end(), std::int32_t{' '});
    std::copy(text.end() - n, text.end(), inputs.begin());
    ex.upload(engine.plan.inputs());
    ex.run(Executor::Phase::eval);
    ex.download(logits);
    const auto all_logits = ex.values(logits);
    const auto logits = std::span(all_logits).subspan(std::size_t(n - 1) * V, V);
    const float top = *std::ranges::max_element(logits);
    std::vector<double> p(V);
    double z = 0;
    for (int v = 0; v < V; ++v) z += p[v] = std::exp((logits[v] - top) / 0.8);
    double u = std::uniform_real_distribution<double>(0, z)(rng);
    int pick = 0;
    while (pick + 1 < V && (u -= p[pick]) > 0) ++pick;
    text.push_back(pick);
    out.push_back(char(pick));
  }
  return out;
}

std::string mib(std::size_t bytes) { return fmt::format("{:.1f} MiB", bytes / 1048576.0); }

// --device cuda: a usable GPU, kernels for it, and room for the plan; checked before anything is
// allocated, each failure one line with the numbers.
void check_cuda(const ModelInfo &info, std::size_t arena_bytes) {
  const cuda::DeviceInfo d = cuda::probe();
  if (!d.built) throw InputError(fmt::format("--device cuda: {}", d.error));
  if (!d.error.empty())
    throw InputError(fmt::format("--device cuda: no usable GPU ({} device(s) found; {})", d.count, d.error));
  if (info.cuda_kernels.empty())
    throw InputError(fmt::format(
        "--device cuda: this build generated no CUDA kernels for model {} (REMAT_CUDA_CAPABILITY=0)", info.name));
  if (arena_bytes > d.free_bytes)
    throw InputError(fmt::format(
        "--device cuda: the plan needs {} B ({:.2f} GiB) of device memory; {} has {} B ({:.2f} GiB) free of {} B",
        arena_bytes, arena_bytes / 1073741824.0, d.name, d.free_bytes, d.free_bytes / 1073741824.0, d.total_bytes));
}

}  // namespace

void print_plan_report(std::FILE *out, const Model &model, const Plan &plan, const CostModel &costs,
                       std::string_view costs_from) {
  fmt::print(out, "plan under policy {} ({}, batch {}, {} rows)\n", plan.policy_label.view(),
             precision_name(plan.precision), plan.batch, plan.rows);
  // each block's kernel calls in schedule order; * marks a call that recomputes forward work
  fmt::print(out, "{:<8} {}\n", "block", "kernel calls in schedule order (* recomputes forward work)");
  for (const Unit &u : units_of(model)) fmt::print(out, "s{}.b{:<4} {}\n", u.stage, u.block, block_calls(plan, u));
  fmt::print(out, "saved for backward:\n");
  fmt::print(out, "{:<8} {:<22} {:>16} {:>12}  {}\n", "block", "tensor", "shape", "bytes", "why");
  std::size_t total = 0;
  std::set<int> fetched;  // restored copies of offloaded tensors
  for (const Step &st : plan.train)
    for (auto [host, into] : st.fetch) fetched.insert(into);
  for (const Step &st : plan.train)
    for (int t : st.alloc) {
      const Tensor &x = plan.tensors[t];
      if (x.role != Role::internal && x.role != Role::block_input) continue;
      // saved = lives past the kernel that wrote it until a backward kernel reads it
      bool read_by_backward = false;
      for (const Step &later : plan.train)
        if (is_backward(later.variant))
          for (const Arg &a : later.args) read_by_backward |= a.tensor == t;
      if (!read_by_backward) continue;
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
      const std::string shape =
          x.dims == 1 ? fmt::format("[{}]", x.extent[0]) : fmt::format("[{}, {}]", x.extent[1], x.extent[0]);
      fmt::print(out, "s{}.b{:<4} {:<22} {:>16} {:>12}  {}\n", x.key.stage, x.key.block, name_of(x.key.local()).view(),
                 shape, x.bytes(), why);
      total += x.bytes();
    }
  double flops = 0, recompute_flops = 0;
  for (const Step &st : plan.train) {
    flops += st.flops;
    if (!st.recompute) continue;
    recompute_flops += is_backward(st.variant) ? st.flops - kernel_flops(model.stages[st.stage],
                                                                         Variant::backward_saved, plan.rows, plan.gemms)
                                               : st.flops;
  }
  const Chain chain = chain_of(model, plan.batch, plan.precision, plan.gemms, costs);
  const Outcome predicted = evaluate(chain, plan.strategy, 0, chain.n());
  fmt::print(
      out,
      "total saved {} B ({}); peak activations {} B; planned arena peak {} B ({}); {} kernel launches ({} recompute)\n",
      total, mib(total), plan.activation_bytes, plan.peak_bytes, mib(plan.peak_bytes), plan.total_launches,
      plan.recompute_launches);
  if (plan.offload_bytes > 0)
    fmt::print(out, "offloaded {} tensors to {} B ({}) of pinned host memory\n", fetched.size(), plan.offload_bytes,
               mib(plan.offload_bytes));
  fmt::print(
      out,
      "recompute {:.3f} GFLOP of {:.3f} per micro-batch; predicted forward + loss + backward {:.2f} ms (costs {})\n",
      recompute_flops / 1e9, flops / 1e9, predicted.seconds * 1e3, costs_from);
}

namespace {
// The budget -> step time table, from the smallest plan to none's peak, and its plot (SVG).
void print_sweep(std::FILE *out, const ModelInfo &info, Device device, Precision precision, int batch,
                 const CostModel &costs, const Options &o, const std::string &program) {
  const Model &m = info.model;
  const Gemms gemms = gemms_of(device, precision);
  const Chain chain = chain_of(m, batch, precision, gemms, costs);
  const long long lo = (long long)smallest_plan(m, batch, precision, gemms).peak_bytes;
  const long long hi = (long long)make_plan(m, none, batch, precision, gemms).peak_bytes;
  std::unique_ptr<DataSource> data;
  if (o.calibrate) data = info.data(m, {o.data_dir, batch, o.seed});
  struct Row {
    long long budget, peak;
    double predicted, measured;
    int launches, recompute;
  };
  std::vector<Row> rows;
  const int points = 9;
  for (int i = 0; i < points; ++i) {
    const long long b = lo + (hi - lo) * i / (points - 1);
    const Planned p = plan_for(m, budget(b), batch, precision, gemms, costs);
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
  // the plot: step time against the budget in MiB
  const std::string path = program + "-sweep.svg";
  write_atomically(path, "sweep plot", [&](std::ostream &svg) {
    const double W = 640, H = 400, L = 70, R = 20, T = 30, B = 50;
    double tmax = 0;
    for (const Row &r : rows) tmax = std::max({tmax, r.predicted, r.measured});
    tmax = tmax > 0 ? tmax * 1.1 : 1;
    const double x0 = lo / 1048576.0, x1 = std::max(hi / 1048576.0, x0 + 1e-9);
    auto X = [&](long long b) { return L + (b / 1048576.0 - x0) / (x1 - x0) * (W - L - R); };
    auto Y = [&](double ms) { return H - B - ms / tmax * (H - T - B); };
    svg << fmt::format(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' font-size='12'>\n", W,
        H);
    svg << fmt::format("<text x='{}' y='18'>{}: step time against the memory budget ({}, batch {})</text>\n", L,
                       info.name, precision_name(precision), batch);
    svg << fmt::format(
        "<line x1='{0}' y1='{1}' x2='{2}' y2='{1}' stroke='black'/><line x1='{0}' y1='{3}' x2='{0}' y2='{1}' "
        "stroke='black'/>\n",
        L, H - B, W - R, T);
    svg << fmt::format("<text x='{}' y='{}'>budget (MiB): {:.1f} .. {:.1f}</text>\n", L, H - 15, x0, x1);
    svg << fmt::format("<text x='5' y='{}'>ms (0 .. {:.1f})</text>\n", T - 5 + 15, tmax);
    for (int series = 0; series < (o.calibrate ? 2 : 1); ++series) {
      std::string points_attr;
      for (const Row &r : rows)
        points_attr += fmt::format("{:.1f},{:.1f} ", X(r.budget), Y(series ? r.measured : r.predicted));
      svg << fmt::format("<polyline fill='none' stroke='{}' stroke-width='2' points='{}'/>\n",
                         series ? "crimson" : "steelblue", points_attr);
      svg << fmt::format("<text x='{}' y='{}' fill='{}'>{}</text>\n", W - R - 150, T + 15 + 15 * series,
                         series ? "crimson" : "steelblue", series ? "measured" : "predicted");
    }
    svg << "</svg>\n";
  });
  fmt::print(out, "plot: {}\n", path);
}
}  // namespace

int train_main(int argc, char **argv, const ModelInfo &info) {
  const std::string program = std::string("train-") + std::string(info.name);
  Options o;
  o.num_train_epochs = info.default_epochs;
  o.max_steps = info.default_max_steps;
  o.learning_rate = info.default_learning_rate;
  o.warmup_steps = info.default_warmup_steps;
  o.eval_samples = info.default_eval_samples;
  o.eval_steps = info.default_eval_steps;
  o.data_dir = info.default_data_dir;
  CLI::App app{fmt::format("Train the {} model with remat (checkpoint policies, AdamW).", info.name), program};
  app.add_option("--max-steps", o.max_steps, "optimizer steps (default: --num-train-epochs worth)")->check(positive);
  app.add_option("--num-train-epochs", o.num_train_epochs, "epochs when --max-steps is not given")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--batch-size", o.batch_size, fmt::format("samples per micro-batch (default {})", info.default_batch))
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
  } catch (const CLI::CallForHelp &e) { return app.exit(e); } catch (const CLI::ParseError &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 2;
  }

  try {
    const Model &model = info.model;
    StagePolicies policies = annotated(model, info.default_policy);
    if (!o.checkpoint_policy.empty()) policies = parse_stage_policies(model, o.checkpoint_policy, policies);
    if (!o.memory_budget.empty()) {
      if (!o.checkpoint_policy.empty())
        throw InputError("--memory-budget: the budget planner chooses the policy; drop --checkpoint-policy");
      policies = parse_budget(o.memory_budget);
    }
    const Device device = o.device == "cuda" ? Device::cuda : Device::cpu;
    if (o.offload && device == Device::cpu)
      throw InputError(
          "--offload: with --device cpu the checkpoints already live in host memory; there is nothing to offload");
    if (o.offload && !o.memory_budget.empty())
      throw InputError("--offload: with --memory-budget the budget planner decides which checkpoints to offload");
    for (Policy &p : policies.stage) {
      p.offload = p.offload || o.offload;
      // on the CPU the arena is host memory: what a model's policy offloads stays in it
      if (device == Device::cpu) {
        p.offload = false;
        p.selection.offloaded = 0;
      }
    }
    const int batch = o.batch_size ? o.batch_size : info.default_batch;
    const int micro = o.gradient_accumulation_steps;
    if (long(batch) * model.rows_per_sample() < min_kernel_rows)
      throw InputError(
          fmt::format("--batch-size {}: the kernels need at least {} rows per micro-batch", batch, min_kernel_rows));
    if (o.dropout > 0 && !has_dropout(model))
      throw InputError(fmt::format("--dropout {}: model {} has no dropout layers", o.dropout, info.name));
    if (o.sweep && !o.plan_report) throw InputError("--sweep: goes with --plan-report");
    const Precision precision = o.bf16 ? Precision::bf16 : Precision::fp32;
    const Gemms gemms = gemms_of(device, precision);
    // kernel costs: measured now (--calibrate), from the table, or estimated
    const std::string cost_table = o.cost_table.empty() ? default_cost_table() : o.cost_table;
    const std::string machine = machine_name(device), key = cost_key(info.name, precision, batch, device);
    CostModel costs;
    std::string costs_from = "estimated from FLOPs and bytes (no --calibrate table for this machine)";
    if (o.calibrate) {
      if (device == Device::cuda) check_cuda(info, 0);
      std::unique_ptr<DataSource> data = info.data(model, {o.data_dir, batch, o.seed});
      costs = calibrate(info, device, precision, batch, *data);
      save_costs(cost_table, machine, key, costs);
      costs_from = fmt::format("measured now on {} ({}, {})", machine, cost_table, key);
      fmt::print(o.json ? stderr : stdout, "{}: calibrated {} kernels on {}; written to {} as {}\n", program,
                 costs.measured.size(), machine, cost_table, key);
    } else if (std::optional<CostModel> stored = load_costs(cost_table, machine, key)) {
      costs = *stored;
      costs_from = fmt::format("measured on {} ({}, {})", machine, cost_table, key);
    }
    // the budget planner may offload checkpoints to pinned host memory on a GPU
    if (device == Device::cuda) costs.transfer_rate = cuda_host_transfer_rate;
    const Planned planned = plan_for(model, policies, batch, precision, gemms, costs);
    if (!planned.ok()) {
      const std::string why(planned.error.view().substr(std::string_view("remat: ").size()));
      throw InputError(o.memory_budget.empty()
                           ? fmt::format("the model's policy {}: {}", policies_name(model, policies).view(), why)
                           : fmt::format("--memory-budget {}: {}", o.memory_budget, why));
    }
    const Plan &plan = planned.plan;
    const std::string policy_label(plan.policy_label.view());
    for (const Tensor &t : plan.tensors)
      if (t.bytes() > std::size_t(INT32_MAX))
        throw InputError(
            fmt::format("--batch-size {}: tensor {} would hold {} bytes; kernels take at most 2 GiB per tensor", batch,
                        name_of(t.key).view(), t.bytes()));
    if (o.offload && plan.offload_bytes == 0)
      throw InputError(fmt::format("--offload: policy {} keeps no checkpoints (use full, every_n_layers=N or sqrt_n)",
                                   policy_label));
    if (o.plan_report) {
      print_plan_report(stdout, model, plan, costs, costs_from);
      if (o.sweep) print_sweep(stdout, info, device, precision, batch, costs, o, program);
      return 0;
    }
    const std::size_t arena_bytes = std::max(plan.peak_bytes, plan.eval_peak_bytes);
    if (device == Device::cuda) check_cuda(info, arena_bytes);
    const Plan baseline = make_plan(model, none, batch, precision, gemms_of(device, precision));
    std::FILE *progress = o.json ? stderr : stdout;
    std::unique_ptr<DataSource> data = info.data(model, {o.data_dir, batch, o.seed});
    if (long(batch) * micro > data->train_samples())
      throw InputError(fmt::format("--batch-size {} x --gradient-accumulation-steps {} exceeds the {} training samples",
                                   batch, micro, data->train_samples()));
    const long steps_per_epoch = data->train_samples() / (long(batch) * micro);
    const long max_steps = o.max_steps ? o.max_steps : o.num_train_epochs * steps_per_epoch;
    if (max_steps > INT32_MAX)
      throw InputError(fmt::format("{} steps: at most {} (the dropout counters are 32-bit)", max_steps, INT32_MAX));
    const long eval_samples = o.eval_samples < 0 ? data->eval_samples() : o.eval_samples;

    if (o.save_steps && o.save_snapshot.empty()) throw InputError("--save-steps needs --save-snapshot FILE");
    Engine engine(plan, info.name, device == Device::cuda ? info.cuda_kernels : info.kernels, {.device = device});
    Arena &arena = engine.arena;
    Scalars &scalars = engine.scalars;
    Executor &ex = engine.executor;
    engine.init_params(o.seed);
    // everything that shapes the sequence of steps; a resume must use the same
    const std::string run_flags = fmt::format(
        "--max-steps {} --batch-size {} --gradient-accumulation-steps {} --learning-rate {} --warmup-steps {} "
        "--lr-scheduler-type {} --weight-decay {} --dropout {}{}",
        max_steps, batch, micro, o.learning_rate, o.warmup_steps, o.lr_scheduler_type, o.weight_decay, o.dropout,
        o.bf16 ? " --bf16" : "");
    if (!o.save_snapshot.empty()) {  // fail now, not after training, if the snapshot cannot be written
      const std::string probe = o.save_snapshot + ".tmp";
      if (!std::ofstream(probe)) throw InputError(fmt::format("--save-snapshot {}: cannot write", o.save_snapshot));
      std::filesystem::remove(probe);
    }
    long first_step = 1;
    if (!o.resume_from_snapshot.empty()) {
      const SnapshotState snap = [&] {
        try {
          return engine.load(o.resume_from_snapshot);
        } catch (const InputError &e) { throw InputError(fmt::format("--resume-from-snapshot: {}", e.what())); }
      }();
      if (snap.seed != o.seed)
        throw InputError(
            fmt::format("--resume-from-snapshot: the snapshot was made with --seed {}, not {}", snap.seed, o.seed));
      if (snap.run != run_flags)
        throw InputError(fmt::format("--resume-from-snapshot: the snapshot's run used {}", snap.run));
      if (snap.step >= max_steps)
        throw InputError(fmt::format("--resume-from-snapshot: the snapshot is at step {}, not before --max-steps {}",
                                     snap.step, max_steps));
      data->restore(snap.data);
      first_step = snap.step + 1;
    }
    // the final snapshot goes to FILE, the ones every --save-steps to FILE.step<N>
    auto save = [&](long step) {
      const std::string path = step == max_steps ? o.save_snapshot : fmt::format("{}.step{}", o.save_snapshot, step);
      try {
        engine.save(path, {step, o.seed, run_flags, data->state()});
      } catch (const InputError &e) { throw InputError(fmt::format("--save-snapshot: {}", e.what())); }
    };
    reset_halide_heap_peak();
    reset_step_heap();
    scalars.seed = o.seed;
    scalars.set_dropout(o.dropout);
    scalars.grad_scale = float(1.0 / (double(plan.rows) * micro));
    scalars.weight_decay = float(o.weight_decay);

    fmt::print(
        progress,
        "{}: {}\n{}: policy {}, {}, batch {} x {}, {} steps, {} parameters, arena {} (activations {}; {} under none)\n",
        program, data->describe(), program, policy_label, precision_name(precision), batch, micro, max_steps,
        plan.param_count, mib(plan.peak_bytes), mib(plan.activation_bytes), mib(baseline.activation_bytes));
    std::fflush(progress);

    // --save-initial: what another implementation needs to repeat the run's first steps
    const std::map<std::string, std::string> initial_metadata = {{"model", std::string(info.name)},
                                                                 {"policy", std::string(policy_label)},
                                                                 {"precision", std::string(precision_name(precision))},
                                                                 {"step", std::to_string(first_step)},
                                                                 {"seed", std::to_string(o.seed)},
                                                                 {"run", run_flags},
                                                                 {"max_steps", std::to_string(max_steps)},
                                                                 {"learning_rate", fmt::format("{}", o.learning_rate)},
                                                                 {"lr_scheduler_type", o.lr_scheduler_type},
                                                                 {"warmup_steps", std::to_string(o.warmup_steps)},
                                                                 {"weight_decay", fmt::format("{}", o.weight_decay)},
                                                                 {"dropout", fmt::format("{}", o.dropout)},
                                                                 {"beta1", fmt::format("{}", scalars.beta1)},
                                                                 {"beta2", fmt::format("{}", scalars.beta2)},
                                                                 {"eps", fmt::format("{}", scalars.eps)}};
    std::vector<double> step_ms;
    double loss_first = 0, loss_last = 0, window_loss = 0;
    long window_correct = 0, window_rows = 0, window_steps = 0;
    std::string grad_digest;
    std::size_t measured_peak = 0;
    double train_seconds = 0;
    for (long step = first_step; step <= max_steps; ++step) {
      const bool first = step == first_step;  // measurements are taken on this run's first step
      auto t0 = std::chrono::steady_clock::now();
      double loss_sum = 0;
      scalars.step = std::int32_t(step);
      for (int m = 0; m < micro; ++m) {
        data->next_train_batch(ex);
        if (first && m == 0 && !o.save_initial.empty()) {  // not timed
          save_initial(o.save_initial, model, plan, ex, initial_metadata);
          t0 = std::chrono::steady_clock::now();
        }
        scalars.accumulate = m > 0;
        ex.run(Executor::Phase::train);
        ex.download(plan.row_loss());
        ex.download(plan.row_correct());
        for (float l : ex.tensor<float>(plan.row_loss())) loss_sum += l;
        for (std::int32_t c : ex.tensor<std::int32_t>(plan.row_correct())) window_correct += c;
        window_rows += plan.rows;
      }
      if (first) {
        ex.download(plan.grads());
        grad_digest = digest(std::as_bytes(ex.tensor<float>(plan.grads())));
      }
      const double lr = learning_rate(o, step, max_steps);
      scalars.lr = float(lr);
      scalars.bias1 = float(1.0 - std::pow(double(scalars.beta1), double(step)));
      scalars.bias2 = float(1.0 - std::pow(double(scalars.beta2), double(step)));
      ex.run(Executor::Phase::optimize);
      arena.synchronize();  // CUDA: the step's time includes its kernels
      const auto t1 = std::chrono::steady_clock::now();
      // What the kernels wrote (guard included) and what Halide allocated; on the CPU, where the
      // arena is host memory, any other heap allocation of the step too. (On CUDA the first step
      // also loads the kernels' modules and cuBLASLt, which allocate host memory: reported as
      // step_heap_bytes, not device memory.)
      if (first)
        measured_peak = arena.high_water() + halide_heap().peak + (device == Device::cpu ? step_heap().bytes : 0);
      const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
      step_ms.push_back(ms);
      train_seconds += ms / 1000;
      const double loss = loss_sum / (double(plan.rows) * micro);
      if (!std::isfinite(loss))
        throw std::runtime_error(fmt::format("loss is {} at step {}; lower --learning-rate", loss, step));
      if (first) loss_first = loss;
      loss_last = loss;
      window_loss += loss;
      ++window_steps;
      if (step % o.logging_steps == 0 || step == max_steps) {
        const long n = window_steps;
        fmt::print(progress,
                   "step {:>5}/{} | epoch {:5.2f} | loss {:.4f} | train acc {:5.1f}% | lr {:.2e} | {:.0f} samples/s\n",
                   step, max_steps, double(step) / std::max(1L, steps_per_epoch), window_loss / n,
                   100.0 * window_correct / std::max(1L, window_rows), lr,
                   double(step - first_step + 1) * batch * micro / train_seconds);
        std::fflush(progress);
        window_loss = 0;
        window_correct = window_rows = window_steps = 0;
      }
      if (o.save_steps > 0 && step % o.save_steps == 0 && step < max_steps) save(step);
      if (o.eval_steps > 0 && step % o.eval_steps == 0 && step < max_steps && eval_samples > 0) {
        const Evaluation e = evaluate(*data, ex, scalars, plan, eval_samples, o.dropout);
        fmt::print(progress, "step {:>5}/{} | eval loss {:.4f} | eval accuracy {:.2f}% ({} samples)\n", step, max_steps,
                   e.loss, 100 * e.accuracy, e.samples);
        std::fflush(progress);
      }
    }

    if (!o.save_snapshot.empty()) save(max_steps);
    std::optional<Evaluation> eval;
    if (eval_samples > 0) {
      eval = evaluate(*data, ex, scalars, plan, eval_samples, o.dropout);
      fmt::print(progress, "eval: {} samples | loss {:.4f} | accuracy {:.2f}%\n", eval->samples, eval->loss,
                 100 * eval->accuracy);
    }
    if (info.sample_length > 0) {
      fmt::print(progress, "sample:\n{}\n", generate(info, device, precision, ex, info.sample_length, o.seed));
    }

    std::vector<double> sorted = step_ms;
    std::ranges::sort(sorted);
    const double median = sorted[sorted.size() / 2];
    const double samples_per_s = double(max_steps - first_step + 1) * batch * micro / train_seconds;
    fmt::print(
        progress,
        "memory: planned peak {} B, measured peak {} B ({}); activations {} under {} vs {} under none ({:.1f}%)\n"
        "speed: {:.0f} samples/s ({:.0f} rows/s), median step {:.1f} ms, {} kernel launches per micro-batch ({} "
        "recompute)\n",
        plan.peak_bytes, measured_peak, measured_peak == plan.peak_bytes ? "equal" : "DIFFERENT",
        mib(plan.activation_bytes), policy_label, mib(baseline.activation_bytes),
        100.0 * plan.activation_bytes / baseline.activation_bytes, samples_per_s,
        samples_per_s * model.rows_per_sample(), median, plan.total_launches, plan.recompute_launches);
    ex.download(plan.params());
    const std::string param_digest = digest(std::as_bytes(ex.tensor<float>(plan.params())));
    if (o.json) {
      auto optional = [&](auto f) { return eval ? nlohmann::json(f(*eval)) : nlohmann::json(); };
      nlohmann::json j = {
          {"model", std::string(info.name)},
          {"policy", std::string(policy_label)},
          {"device", o.device},
          {"precision", std::string(precision_name(precision))},
          {"offload_bytes", plan.offload_bytes},
          {"batch_size", batch},
          {"gradient_accumulation_steps", micro},
          {"dropout", o.dropout},
          {"steps", max_steps},
          {"loss_first", loss_first},
          {"loss_last", loss_last},
          {"eval_accuracy", optional([](const Evaluation &e) { return e.accuracy; })},
          {"eval_loss", optional([](const Evaluation &e) { return e.loss; })},
          {"val_loss", optional([](const Evaluation &e) { return e.loss; })},
          {"samples_per_s", samples_per_s},
          {"tokens_per_s", samples_per_s * model.rows_per_sample()},
          {"step_ms_median", median},
          {"step_ms", step_ms},
          {"planned_peak_bytes", plan.peak_bytes},
          {"measured_peak_bytes", measured_peak},
          {"halide_heap_peak_bytes", halide_heap().peak},
          {"step_heap_allocations", step_heap().allocations},
          {"step_heap_bytes", step_heap().bytes},
          {"activation_bytes", plan.activation_bytes},
          {"activation_bytes_none", baseline.activation_bytes},
          {"param_count", plan.param_count},
          {"kernel_launches", plan.total_launches},
          {"recompute_launches", plan.recompute_launches},
          {"grad_digest", grad_digest},
          {"param_digest", param_digest},
      };
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);  // the summary is out even if teardown fails later
    }
    return 0;
  } catch (const InputError &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 2;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 1;
  }
}

Policy parse_policy(std::string_view text) {
  Policy out;
  std::string_view rest = text;
  try {
    while (true) {
      const std::size_t plus = rest.find('+');
      const std::string_view part = rest.substr(0, plus);
      constexpr std::string_view every = "every_n_layers=";
      if (part == "none")
        out = out | none;
      else if (part == "full")
        out = out | full;
      else if (part == "sqrt_n")
        out = out | sqrt_n;
      else if (part == "selective")
        out = out | selective;
      else if (part == "offload")
        out = out | offload;
      else if (part.starts_with(every)) {
        int n = 0;
        const auto digits = part.substr(every.size());
        const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
        if (digits.empty() || err != std::errc() || end != digits.data() + digits.size() || n < 1)
          throw InputError(fmt::format("--checkpoint-policy {}: every_n_layers needs a whole number N >= 1", text));
        out = out | Policy{Policy::Kind::every_n_layers, n};
      } else {
        throw InputError(
            fmt::format("--checkpoint-policy {}: unknown policy {} (use none, full, every_n_layers=N, sqrt_n, "
                        "selective or offload, composed with +)",
                        text, part));
      }
      if (plus == std::string_view::npos) break;
      rest = rest.substr(plus + 1);
    }
  } catch (const char *why) {  // two schedules that do not compose
    throw InputError(fmt::format("--checkpoint-policy {}: {}", text,
                                 std::string_view(why).substr(std::string_view("remat: ").size())));
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
