module;
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>
module remat.runtime;
import remat;

namespace remat::runtime {
namespace {

constexpr int min_batch = 8;  // GEMM register tiles are up to 6 rows; see generators/modelc.cpp

struct Options {
  int max_steps = 0;  // 0: derived from num_train_epochs
  int num_train_epochs = 0;
  int batch_size = 0;
  int gradient_accumulation_steps = 1;
  double learning_rate = 1e-3;
  double weight_decay = 0.01;
  std::string lr_scheduler_type = "cosine";
  int warmup_steps = 0;
  std::uint64_t seed = 42;
  std::string checkpoint_policy;
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  int eval_samples = -1;  // -1: the whole test split
  int logging_steps = 50;
  bool json = false;
};

// Deterministic uniform in [-1, 1) from a 64-bit generator (the same on every platform).
float uniform(std::mt19937_64 &rng) { return float(double(rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }

void init_params(const Plan &plan, Executor &ex, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (const Tensor &t : plan.tensors) {
    if (t.role != Role::params || t.view_of < 0 || t.name.view().find('.') == std::string_view::npos)
      continue;
    auto values = ex.tensor<float>(t.name.view());
    const bool weight = t.name.view().ends_with("_w");
    if (weight && t.dims == 2) {  // linear weight [K, O]: U(-1/sqrt(K), 1/sqrt(K)) as PyTorch
      const float bound = 1.f / std::sqrt(float(t.extent[1]));
      for (float &v : values) v = bound * uniform(rng);
    } else {
      std::fill(values.begin(), values.end(), weight ? 1.f : 0.f);  // LayerNorm gamma / biases
    }
  }
  for (auto name : {"adam_m", "adam_v"}) std::ranges::fill(ex.tensor<float>(name), 0.f);
}

double learning_rate(const Options &o, int step, int max_steps) {  // step counts from 1
  if (step <= o.warmup_steps) return o.learning_rate * step / std::max(1, o.warmup_steps);
  if (o.lr_scheduler_type == "constant") return o.learning_rate;
  const double progress = double(step - o.warmup_steps) / std::max(1, max_steps - o.warmup_steps);
  return o.learning_rate * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

// Copies rows order[first .. first + B) into the images/labels tensors; rows past the end of
// `order` repeat its first row (only evaluation asks for a partial batch).
void load_batch(const Dataset &ds, const std::vector<int> &order, std::size_t first, Executor &ex) {
  auto images = ex.tensor<float>("images");
  auto labels = ex.tensor<std::int32_t>("labels");
  const std::size_t batch = labels.size();
  for (std::size_t r = 0; r < batch; ++r) {
    const int row = order[first + r < order.size() ? first + r : 0];
    std::copy_n(ds.images.begin() + std::size_t(row) * ds.width, ds.width, images.begin() + r * ds.width);
    labels[r] = ds.labels[row];
  }
}

std::string mib(std::size_t bytes) { return fmt::format("{:.1f} MiB", bytes / 1048576.0); }

}  // namespace

int train_main(int argc, char **argv, const ModelInfo &info) {
  const std::string program = std::string("train-") + std::string(info.name);
  Options o;
  o.num_train_epochs = info.default_epochs;
  o.learning_rate = info.default_learning_rate;
  o.warmup_steps = info.default_warmup_steps;
  CLI::App app{fmt::format("Train the {} model with remat (checkpoint policies, AdamW).", info.name), program};
  app.add_option("--max-steps", o.max_steps, "optimizer steps (default: --num-train-epochs worth)")->check(CLI::PositiveNumber);
  app.add_option("--num-train-epochs", o.num_train_epochs, "epochs when --max-steps is not given")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--batch-size", o.batch_size, fmt::format("rows per micro-batch (default {})", info.default_batch))->check(CLI::PositiveNumber);
  app.add_option("--gradient-accumulation-steps", o.gradient_accumulation_steps, "micro-batches per optimizer step")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--learning-rate", o.learning_rate, "peak AdamW learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay on linear weights")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--lr-scheduler-type", o.lr_scheduler_type, "learning-rate schedule after warm-up")->check(CLI::IsMember({"constant", "cosine"}))->capture_default_str();
  app.add_option("--warmup-steps", o.warmup_steps, "linear warm-up steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  app.add_option("--seed", o.seed, "seed for initialization and shuffling")->capture_default_str();
  app.add_option("--checkpoint-policy", o.checkpoint_policy, fmt::format("none | full | every_n_layers=N | sqrt_n (default {})", policy_name(info.default_policy).view()));
  app.add_option("--data-dir", o.data_dir, "folder with the idx files")->capture_default_str();
  app.add_option("--eval-samples", o.eval_samples, "test rows to evaluate at the end (default all, 0 skips)")->check(CLI::NonNegativeNumber);
  app.add_option("--logging-steps", o.logging_steps, "print progress every N steps")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_flag("--json", o.json, "print a JSON summary as the last line of stdout (progress goes to stderr)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp &e) {
    return app.exit(e);
  } catch (const CLI::ParseError &e) {
    std::fprintf(stderr, "%s: error: %s\n", program.c_str(), e.what());
    return 2;
  }

  try {
    const Policy policy = o.checkpoint_policy.empty() ? info.default_policy : parse_policy(o.checkpoint_policy);
    const int batch = o.batch_size ? o.batch_size : info.default_batch;
    const int micro = o.gradient_accumulation_steps;
    std::FILE *progress = o.json ? stderr : stdout;

    const Dataset train = load_idx(o.data_dir + "/train-images-idx3-ubyte.gz", o.data_dir + "/train-labels-idx1-ubyte.gz", info.model.classes());
    const Dataset test = load_idx(o.data_dir + "/t10k-images-idx3-ubyte.gz", o.data_dir + "/t10k-labels-idx1-ubyte.gz", info.model.classes());
    if (train.width != info.model.input_width || test.width != info.model.input_width)
      throw InputError(fmt::format("{}: images have {} pixels but the model takes {}", o.data_dir, train.width, info.model.input_width));
    if (batch < min_batch)
      throw InputError(fmt::format("--batch-size {}: the CPU kernels need at least {} rows per micro-batch", batch, min_batch));
    if (long(batch) * micro > train.rows)
      throw InputError(fmt::format("--batch-size {} x --gradient-accumulation-steps {} exceeds the {} training rows", batch, micro, train.rows));

    const Plan plan = make_plan(info.model, policy, batch, info.name);
    const Plan baseline = make_plan(info.model, none, batch, info.name);
    const int steps_per_epoch = train.rows / (batch * micro);
    const int max_steps = o.max_steps ? o.max_steps : o.num_train_epochs * steps_per_epoch;

    Arena arena(std::max(plan.peak_bytes, plan.eval_peak_bytes));
    arena.fill_canary();
    Scalars scalars;
    Executor ex(plan, info.name, info.kernels, arena, scalars);
    init_params(plan, ex, o.seed);
    reset_halide_heap_peak();

    fmt::print(progress, "{}: policy {}, batch {} x {}, {} steps, {} parameters, arena {} (activations {}; {} under none)\n",
               program, policy_name(policy).view(), batch, micro, max_steps, plan.param_count,
               mib(plan.peak_bytes), mib(plan.activation_bytes), mib(baseline.activation_bytes));
    std::fflush(progress);

    std::mt19937_64 shuffle_rng(o.seed ^ 0x5eedf00dull);
    std::vector<int> order(train.rows);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), shuffle_rng);
    std::size_t cursor = 0;

    std::vector<double> step_ms;
    double loss_first = 0, loss_last = 0, window_loss = 0;
    long window_correct = 0, window_rows = 0;
    std::string grad_digest;
    std::size_t measured_peak = 0;
    double train_seconds = 0;
    scalars.grad_scale = float(1.0 / (double(batch) * micro));
    scalars.weight_decay = float(o.weight_decay);
    for (int step = 1; step <= max_steps; ++step) {
      const auto t0 = std::chrono::steady_clock::now();
      double loss_sum = 0;
      for (int m = 0; m < micro; ++m) {
        if (cursor + batch > order.size()) {  // next epoch
          std::shuffle(order.begin(), order.end(), shuffle_rng);
          cursor = 0;
        }
        load_batch(train, order, cursor, ex);
        cursor += batch;
        scalars.accumulate = m > 0;
        ex.run(Executor::Phase::train);
        for (float l : ex.tensor<float>("row_loss")) loss_sum += l;
        for (std::int32_t c : ex.tensor<std::int32_t>("row_correct")) window_correct += c;
        window_rows += batch;
      }
      if (step == 1) grad_digest = digest(std::as_bytes(ex.tensor<float>("grads")));
      const double lr = learning_rate(o, step, max_steps);
      scalars.lr = float(lr);
      scalars.bias1 = float(1.0 - std::pow(double(scalars.beta1), step));
      scalars.bias2 = float(1.0 - std::pow(double(scalars.beta2), step));
      ex.run(Executor::Phase::optimize);
      const auto t1 = std::chrono::steady_clock::now();
      if (step == 1) measured_peak = arena.high_water() + halide_heap().peak;
      const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
      step_ms.push_back(ms);
      train_seconds += ms / 1000;
      const double loss = loss_sum / (double(batch) * micro);
      if (!std::isfinite(loss))
        throw std::runtime_error(fmt::format("loss is {} at step {}; lower --learning-rate", loss, step));
      if (step == 1) loss_first = loss;
      loss_last = loss;
      window_loss += loss;
      if (step % o.logging_steps == 0 || step == max_steps) {
        const int n = step % o.logging_steps ? step % o.logging_steps : o.logging_steps;
        fmt::print(progress, "step {:>5}/{} | epoch {:5.2f} | loss {:.4f} | train acc {:5.1f}% | lr {:.2e} | {:.0f} samples/s\n",
                   step, max_steps, double(step) / std::max(1, steps_per_epoch), window_loss / n,
                   100.0 * window_correct / std::max(1L, window_rows), lr,
                   double(step) * batch * micro / train_seconds);
        std::fflush(progress);
        window_loss = 0;
        window_correct = window_rows = 0;
      }
    }

    // ---- evaluation on the test split ----
    std::optional<double> eval_accuracy, eval_loss;
    const int eval_rows = o.eval_samples < 0 ? test.rows : std::min(o.eval_samples, test.rows);
    if (eval_rows > 0) {
      std::vector<int> rows(eval_rows);
      std::iota(rows.begin(), rows.end(), 0);
      double loss_sum = 0;
      long correct = 0;
      for (int first = 0; first < eval_rows; first += batch) {
        load_batch(test, rows, first, ex);
        ex.run(Executor::Phase::eval);
        const auto l = ex.tensor<float>("row_loss");
        const auto c = ex.tensor<std::int32_t>("row_correct");
        for (int r = 0; r < batch && first + r < eval_rows; ++r) {
          loss_sum += l[r];
          correct += c[r];
        }
      }
      eval_accuracy = double(correct) / eval_rows;
      eval_loss = loss_sum / eval_rows;
      fmt::print(progress, "eval: {} test rows | loss {:.4f} | accuracy {:.2f}%\n", eval_rows, *eval_loss, 100 * *eval_accuracy);
    }

    std::vector<double> sorted = step_ms;
    std::ranges::sort(sorted);
    const double median = sorted[sorted.size() / 2];
    const double samples_per_s = double(max_steps) * batch * micro / train_seconds;
    fmt::print(progress,
               "memory: planned peak {} B, measured peak {} B ({}); activations {} under {} vs {} under none ({:.1f}%)\n"
               "speed: {:.0f} samples/s, median step {:.1f} ms, {} kernel launches per micro-batch ({} recompute)\n",
               plan.peak_bytes, measured_peak, measured_peak == plan.peak_bytes ? "equal" : "DIFFERENT",
               mib(plan.activation_bytes), policy_name(policy).view(), mib(baseline.activation_bytes),
               100.0 * plan.activation_bytes / baseline.activation_bytes, samples_per_s, median,
               plan.total_launches, plan.recompute_launches);
    if (o.json) {
      nlohmann::json j = {
          {"model", std::string(info.name)},
          {"policy", std::string(policy_name(policy).view())},
          {"batch_size", batch},
          {"gradient_accumulation_steps", micro},
          {"steps", max_steps},
          {"loss_first", loss_first},
          {"loss_last", loss_last},
          {"eval_accuracy", eval_accuracy ? nlohmann::json(*eval_accuracy) : nlohmann::json()},
          {"eval_loss", eval_loss ? nlohmann::json(*eval_loss) : nlohmann::json()},
          {"samples_per_s", samples_per_s},
          {"step_ms_median", median},
          {"planned_peak_bytes", plan.peak_bytes},
          {"measured_peak_bytes", measured_peak},
          {"halide_heap_peak_bytes", halide_heap().peak},
          {"activation_bytes", plan.activation_bytes},
          {"activation_bytes_none", baseline.activation_bytes},
          {"param_count", plan.param_count},
          {"kernel_launches", plan.total_launches},
          {"recompute_launches", plan.recompute_launches},
          {"grad_digest", grad_digest},
      };
      std::printf("%s\n", j.dump().c_str());
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

}  // namespace remat::runtime
