// The training loop: an engine for the plan, the data, a resumed snapshot's state, then the steps
// (micro-batches, AdamW, progress, snapshots, evaluations), the final evaluation and a sample.
module;
#include "cuda_device.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <climits>
#include <csignal>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <sys/ioctl.h>
#include <unistd.h>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace {

volatile std::sig_atomic_t terminate_requested = 0;
extern "C" void request_termination(int) { terminate_requested = 1; }
}  // namespace

// From the start (a SIGTERM while the run sets up stops it after its first step too).
void stop_on_sigterm() { std::signal(SIGTERM, request_termination); }

namespace {

// No NaN or infinity in v: each value's exponent bits, all ones only there, carried into the sign
// bit and or-ed (a branch-free scan the compiler vectorizes, AVX-512 or AVX2 where the CPU has them).
__attribute__((target_clones("avx512f", "avx2", "default"))) bool all_finite(std::span<const float> v) {
  std::uint32_t carried = 0;
  for (float x : v) carried |= (std::bit_cast<std::uint32_t>(x) & 0x7f800000u) + 0x00800000u;
  return (carried & 0x80000000u) == 0;
}

// Linear warm-up, then constant or cosine decay.
double learning_rate(const Options &o, long step, long max_steps) {  // step counts from 1
  if (step <= o.warmup_steps) return o.learning_rate * step / std::max(1, o.warmup_steps);
  if (o.lr_scheduler_type == "constant") return o.learning_rate;
  // progress 0 on the first step after warm-up, below 1 on the last step (which still learns)
  const double progress = double(step - o.warmup_steps - 1) / std::max(1L, max_steps - o.warmup_steps);
  return o.learning_rate * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

// Forward-discard over `samples` evaluation samples (dropout off); with ranks, each takes every
// ranks-th batch of them and the sums are the ranks' together.
Evaluation evaluate(DataSource &data, Executor &ex, Scalars &scalars, const Plan &plan, long samples, double dropout) {
  const Ranks &ranks = Ranks::world();
  Evaluation e;
  e.samples = std::min(samples, data.eval_samples());
  if (e.samples == 0) throw InputError("the evaluation split is empty (pass --eval-samples 0 to skip evaluation)");
  const long rows_per_sample = plan.rows / plan.batch;
  double loss_sum = 0;
  long correct = 0;
  scalars.set_dropout(0);
  for (long first = long(ranks.rank) * plan.batch; first < e.samples; first += long(plan.batch) * ranks.size) {
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
  Ranks::Sums sums{loss_sum, correct};
  ranks.sum(sums);
  loss_sum = sums.loss;
  correct = sums.correct;
  scalars.set_dropout(dropout);
  e.loss = loss_sum / double(e.samples * rows_per_sample);
  e.accuracy = double(correct) / double(e.samples * rows_per_sample);
  return e;
}

// Autoregressive sampling from a token model: a plan for one sequence, the trained parameters,
// and the logits of the last filled position, at temperature 0.8. Returns the sampled tokens after
// `prompt` (not empty); the positions past the filled ones hold the prompt's first token (a causal
// model does not read them).
std::vector<std::int32_t> generate(const ModelInfo &info, Device device, Precision precision, Executor &trained,
                                   std::vector<std::int32_t> prompt, int length, std::uint64_t seed) {
  const Model &model = info.model;
  const int T = model.input.block_size, V = model.classes();
  const int samples = (min_kernel_rows + T - 1) / T;  // the sequence is sample 0; the rest pad the batch
  StagePolicies whole_head(none);  // the logits of the last position are read: the head runs unchunked
  whole_head.unfused_head = true;
  Engine engine(make_plan(model, whole_head, samples, precision), info.name,
                device == Device::cuda ? info.cuda_kernels : info.kernels, {.device = device, .canary = false});
  Executor &ex = engine.executor;
  trained.download(trained.plan.params());
  std::ranges::copy(trained.tensor<float>(trained.plan.params()), ex.tensor<float>(engine.plan.params()).begin());
  ex.upload(engine.plan.params());
  const TensorId logits = engine.plan.logits(Phase::eval);
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> text = prompt, out;
  auto inputs = ex.tensor<std::int32_t>(engine.plan.inputs());
  for (int i = 0; i < length; ++i) {
    const int n = std::min<int>(int(text.size()), T);
    std::fill(inputs.begin(), inputs.end(), prompt.front());
    std::copy(text.end() - n, text.end(), inputs.begin());
    ex.upload(engine.plan.inputs());
    ex.run(Executor::Phase::eval);
    ex.download(logits);
    const auto all_logits = ex.values(logits);
    const auto last = std::span(all_logits).subspan(std::size_t(n - 1) * V, V);  // of the last filled position
    const float top = *std::ranges::max_element(last);
    std::vector<double> p(V);
    double z = 0;
    for (int v = 0; v < V; ++v) z += p[v] = std::exp((last[v] - top) / 0.8);
    double u = std::uniform_real_distribution<double>(0, z)(rng);
    int pick = 0;
    while (pick + 1 < V && (u -= p[pick]) > 0) ++pick;
    text.push_back(pick);
    out.push_back(pick);
  }
  return out;
}

// The sample after training: text as characters; token ids as numbers, the prompt first, for the
// tokenizer to decode (scripts/bpe.py decode), since the trainer does not know it.
void print_sample(std::FILE *progress, const ModelInfo &info, const Run &run, Executor &ex, const DataSource &data,
                  int length, std::uint64_t seed) {
  const std::vector<std::int32_t> prompt = data.sample_prompt();
  if (length <= 0 || prompt.empty()) return;
  const std::vector<std::int32_t> ids = generate(info, run.device, run.precision, ex, prompt, length, seed);
  if (info.data == Data::tokens)
    fmt::print(progress, "sample ids: {} {}\n", fmt::join(prompt, " "), fmt::join(ids, " "));
  else
    fmt::print(progress, "sample:\n{}\n", std::string(ids.begin(), ids.end()));
}

// The kernel calls of a plan's step and its peak: ranks whose plans differ (a memory budget solved
// with other measured costs) would exchange other gradients at each bucket.
std::string schedule_digest(const Plan &plan) {
  std::vector<long long> calls{(long long)plan.peak_bytes};
  for (const Step &st : plan.train)
    calls.insert(calls.end(), {st.stage, st.block, (long long)st.variant, (long long)st.args.size()});
  return fmt::format("{} B {}", plan.peak_bytes, digest(std::as_bytes(std::span(calls))));
}

// Where ranks other than 0 write their progress: nowhere.
std::FILE *null_stream() {
  static std::FILE *null = std::fopen("/dev/null", "w");
  return null;
}

// "1:05", "2:03:07"
std::string clock_text(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
                   : fmt::format("{}:{:02}", s / 60, s % 60);
}

// The width of the terminal `out` writes to (0: unknown).
int terminal_columns(std::FILE *out) {
  winsize w{};
  return ::ioctl(::fileno(out), TIOCGWINSZ, &w) == 0 ? w.ws_col : 0;
}

// One training run, step by step.
class Training {
public:
  Training(const Options &o, const ModelInfo &info, const Run &run, const std::string &program)
      : o(o),
        info(info),
        run(run),
        plan(run.plan),
        program(program),
        output_lock(o.output_dir.empty() || ranks.rank > 0 ? OutputDirLock() : OutputDirLock(o.output_dir)),
        progress(ranks.rank > 0 ? null_stream()
                 : o.json       ? stderr
                                : stdout),
        data(data_source(info, data_options(o, run.batch))),
        steps_per_epoch(checked_steps_per_epoch(*data, run)),
        max_steps(checked_max_steps(o, steps_per_epoch)),
        // rank 0's files
        timeline(o.memory_timeline.empty() || ranks.rank > 0
                     ? nullptr
                     : std::make_unique<MemoryTimeline>(o.memory_timeline, program)),
        metrics(o.logging_dir.empty() || ranks.rank > 0 ? nullptr
                                                        : std::make_unique<MetricsLog>(o.logging_dir, metrics_setup())),
        engine(run.plan, info.name, run.device == Device::cuda ? info.cuda_kernels : info.kernels,
               {.device = run.device}),
        ex(engine.executor),
        scalars(engine.scalars) {
    summary.max_steps = max_steps;
    live = ::isatty(::fileno(progress)) == 1;
    eval_samples = o.eval_samples < 0 ? data->eval_samples() : o.eval_samples;
    // everything that shapes the sequence of steps; a resume must use the same (with the batch of
    // all ranks together: any number of ranks resumes a snapshot of the same global batch)
    run_flags = fmt::format(
        "--max-steps {} --batch-size {} --gradient-accumulation-steps {} --learning-rate {} --warmup-steps {} "
        "--lr-scheduler-type {} --weight-decay {} --dropout {}{}",
        summary.max_steps, run.batch * ranks.size, run.micro, o.learning_rate, o.warmup_steps, o.lr_scheduler_type,
        o.weight_decay, o.dropout, o.bf16 ? " --bf16" : "");
    ranks.check_same("builds or flags",
                     fmt::format("remat {}, model {} ({}), policy {}, --batch-size {} per rank{}, {}, plan {}",
                                 remat_version(), info.name, definition_digest(info.model), run.policy_label, run.batch,
                                 o.shard_optimizer ? ", --shard-optimizer" : "", run_flags, schedule_digest(plan)));
    if (ranks.data_parallel) {
      reducer = std::make_unique<GradientReducer>(ranks, ex);
      summary.collectives = reducer->describe();
      summary.collectives_device_bytes = ranks.most(reducer->device_bytes_outside_arena());
    }
    engine.init_params(o.seed);
    initial_max_abs = max_abs_param();
    check_transformers_flags();
    if (!o.init_from.empty()) init_from();
    if (!o.output_dir.empty() && ranks.rank == 0) check_output_dir(o.output_dir, snapshot_bytes(plan));
    if (!o.resume_from_snapshot.empty()) resume();
    reset_halide_heap_peak();
    reset_step_heap();
    scalars.seed = o.seed;
    scalars.set_dropout(o.dropout);
    scalars.grad_scale = float(1.0 / (double(plan.rows) * run.micro * ranks.size));  // the global batch's mean
    scalars.weight_decay = float(o.weight_decay);
  }

  Summary train() {
    const Plan none_plan = make_plan(info.model, none, run.batch, run.precision);
    summary.activation_bytes_none = none_plan.activation_bytes;
    fmt::print(
        progress,
        "{}: {}\n{}: policy {}, {}, batch {} x {}{}, {} steps, {} parameters, arena {} (activations {}; {} under "
        "none)\n",
        program, data->describe(), program, run.policy_label, precision_name(run.precision), run.batch, run.micro,
        reducer ? fmt::format(" x {} ranks (arena per rank; {})", ranks.size, reducer->describe()) : "",
        summary.max_steps, plan.param_count, mib(plan.peak_bytes), mib(plan.activation_bytes),
        mib(none_plan.activation_bytes));
    std::fflush(progress);
    started = std::chrono::steady_clock::now();
    for (long step = summary.first_step; step <= summary.max_steps; ++step) {
      if (this->step(step)) log(step);
      summary.last_step = step;
      const std::string stop = step < summary.max_steps ? stop_reason(step) : "";
      if ((step == summary.max_steps || !stop.empty()) && !o.save_gradients.empty()) try {  // the run's last step
          save_gradients(ex, plan, info, o.save_gradients);
        } catch (const InputError &e) { throw InputError(fmt::format("--save-gradients {}", e.what())); }
      const bool save_now = step == summary.max_steps || (o.save_steps > 0 && step % o.save_steps == 0);
      if (!o.output_dir.empty() && (save_now || !stop.empty())) save(step);
      std::optional<Evaluation> e;
      if (o.eval_steps > 0 && step % o.eval_steps == 0 && step < summary.max_steps && eval_samples > 0) {
        e = evaluate(*data, ex, scalars, plan, eval_samples, o.dropout);
        clear_live_line();
        fmt::print(progress, "step {:>5}/{} | eval loss {:.4f} | eval accuracy {:.2f}% ({} samples)\n", step,
                   summary.max_steps, e->loss, 100 * e->accuracy, e->samples);
        std::fflush(progress);
      }
      if (metrics && step < summary.max_steps) metrics->step(last, e);  // the last step's: with the final evaluation
      if (!stop.empty()) {
        clear_live_line();
        fmt::print(progress, "{}: stopped after step {} ({}){}\n", program, step, stop,
                   o.output_dir.empty() ? "" : fmt::format("; continue with --resume-from-snapshot {}", o.output_dir));
        break;
      }
    }
    clear_live_line();
    const bool ended = summary.last_step == summary.max_steps;  // not stopped before --max-steps
    if (ended && eval_samples > 0) {
      summary.eval = evaluate(*data, ex, scalars, plan, eval_samples, o.dropout);
      fmt::print(progress, "eval: {} samples | loss {:.4f} | accuracy {:.2f}%\n", summary.eval->samples,
                 summary.eval->loss, 100 * summary.eval->accuracy);
    }
    if (metrics) {
      const long steps = summary.last_step - summary.first_step + 1;
      if (ended) metrics->step(last, summary.eval);
      metrics->finish(summary.last_step, epoch(summary.last_step), loss_total / steps, seconds_since(started), steps,
                      steps * run.batch * run.micro * ranks.size);
    }
    if (ended && ranks.rank == 0) print_sample(progress, info, run, ex, *data, o.sample_length, o.seed);
    if (ended && ranks.rank == 0 && !o.save_hf.empty()) save_hf(o.save_hf);
    return finish();
  }

private:
  Summary finish() {
    ex.download(plan.params());
    summary.param_digest = digest(std::as_bytes(ex.tensor<float>(plan.params())));
    return summary;
  }
  // Why the run stops before --max-steps after `step` ("": it does not): --exit-interval, or a
  // SIGTERM (a scheduler's preemption) that arrived during the step.
  std::string stop_reason(long step) const {
    if (reducer ? terminating_ranks > 0 : terminate_requested != 0) return "SIGTERM";
    if (o.exit_interval > 0 && step % o.exit_interval == 0) return fmt::format("--exit-interval {}", o.exit_interval);
    return {};
  }
  // One optimizer step: its micro-batches (forward, loss, backward), then AdamW. The first step of
  // the run also gives the gradient digest and the measured peak (what the kernels wrote, guard
  // included, and what Halide allocated; on the CPU, where the arena is host memory, any other
  // heap allocation of the step too; on CUDA the first step also loads the kernels' modules and
  // cuBLASLt, which allocate host memory: reported as step_heap_bytes, not device memory).
  bool step(long step) {  // false: skipped (--skip-nonfinite-steps)
    const bool first = step == summary.first_step;
    if (first && timeline) timeline->start(engine, info.name, run.policy_label);
    auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    long correct = 0;
    scalars.step = std::int32_t(step);
    for (int m = 0; m < run.micro; ++m) {
      data->next_train_batch(ex);
      if (first && m == 0 && !o.save_initial.empty() && ranks.rank == 0) {  // not timed; rank 0's share
        save_initial(o.save_initial, info.model, plan, ex, initial_metadata());
        t0 = std::chrono::steady_clock::now();
      }
      scalars.accumulate = m > 0;
      scalars.first_row = std::int32_t((long(m) * ranks.size + ranks.rank) * plan.rows);
      const bool reduce = reducer && m + 1 == run.micro;  // the gradients are final in this one
      if (reduce) reducer->start();
      ex.run(Executor::Phase::train);
      if (reduce) summary.allreduce.push_back(reducer->finish());
      ex.download(plan.row_loss());
      ex.download(plan.row_correct());
      for (float l : ex.tensor<float>(plan.row_loss())) loss_sum += l;
      for (std::int32_t c : ex.tensor<std::int32_t>(plan.row_correct())) correct += c;
      // with ranks, each decides on the sums (the same everywhere), after the last micro-batch
      if (!reducer && (!std::isfinite(loss_sum) || !finite(plan.grads()))) return nonfinite(step, m, loss_sum);
    }
    std::span<const float> summed;  // with ranks: the gradients this rank holds summed
    if (reducer) {                  // the global batch's (the gradients were summed during backward: GradientReducer)
      summed = reducer->summed_gradients();
      Ranks::Sums sums{loss_sum, correct, all_finite(summed) ? 0 : 1, terminate_requested};
      {
        CountedHeap counted;  // what MPI allocates is the step's too
        ranks.sum(sums);
      }
      loss_sum = sums.loss;
      correct = sums.correct;
      terminating_ranks = sums.terminating;
      if (!std::isfinite(loss_sum) || sums.nonfinite > 0) return nonfinite(step, run.micro - 1, loss_sum);
    }
    if (first) {  // (sharded: of this rank's shard, what it holds summed)
      if (!reducer) {
        ex.download(plan.grads());
        summed = ex.tensor<float>(plan.grads());
      }
      summary.grad_digest = digest(std::as_bytes(summed));
    }
    lr = learning_rate(o, step, summary.max_steps);
    scalars.lr = float(lr);
    scalars.bias1 = float(1.0 - std::pow(double(scalars.beta1), double(step)));
    scalars.bias2 = float(1.0 - std::pow(double(scalars.beta2), double(step)));
    ex.run(Executor::Phase::optimize);
    if (reducer) {  // sharded: each rank updated its shard
      CountedHeap counted;
      reducer->gather_parameters();
    }
    engine.arena.synchronize();  // CUDA: the step's time includes its kernels
    const auto t1 = std::chrono::steady_clock::now();
    if (first) {
      const MeasuredPeak measured{engine.arena.high_water(), halide_heap().peak,
                                  run.device == Device::cpu ? step_heap().bytes : 0};
      summary.measured_peak = ranks.most(measured.total());  // every rank runs the same plan
      if (timeline) timeline->finish(measured);
    }
    const double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    summary.step_ms.push_back(ms);
    summary.train_seconds += ms / 1000;
    const long rows = long(plan.rows) * run.micro * ranks.size;  // of the global batch
    const double loss = loss_sum / double(rows);
    if (first) summary.loss_first = loss;
    summary.loss_last = loss;
    last = {step, epoch(step), loss, lr, double(correct) / double(rows), ms, double(rows) / (ms / 1000)};
    loss_total += loss;
    window_loss += loss;
    window_ms += ms;
    window_correct += correct;
    window_rows += rows;
    ++window_steps;
    return true;
  }
  // The guard: a NaN or an infinity in micro-batch m's loss or gradients. The micro-batch runs again
  // (its batch is still in the arena; the parameters are those of the step) with every written
  // tensor checked, and the first one found non-finite is named, with a cause when one shows: a
  // non-finite input, or parameters grown far beyond their start (the learning rate). The step is
  // skipped (AdamW does not run) while --skip-nonfinite-steps allows, otherwise training stops.
  bool nonfinite(long step, int m, double loss_sum) {
    const std::string what = std::isfinite(loss_sum) ? "the gradients hold" : "the loss is";
    std::string where = "no tensor of the step's replay is (the values differ between runs?)";
    ex.observe = [&, found = false](Executor::Phase, std::size_t i, bool done) mutable {
      if (!done || found) return;
      const Step &st = plan.train[i];
      for (const Arg &a : st.args)
        if (a.access == Access::write && plan.tensors[a.tensor].kind != LocalTensor::Kind::index &&
            !finite(TensorId{a.tensor})) {
          where = fmt::format("{} (written by the {}{} kernel of stage {} block {})",
                              name_of(plan.tensors[a.tensor].key).view(), variant_name(st.variant),
                              st.recompute ? " recompute" : "", st.stage, st.block);
          found = true;
          return;
        }
    };
    scalars.accumulate = false;
    ex.run(Executor::Phase::train);
    ex.observe = nullptr;
    std::string cause;
    if (!info.model.token_input() && !finite(plan.inputs())) {
      cause = "; the input batch holds NaN or infinite values (check the data)";
    } else if (const float now = max_abs_param(); now > 100 * initial_max_abs) {
      cause = fmt::format(
          "; the parameters grew from max |w| {:.3g} at initialization to {:.3g}: --learning-rate {} is "
          "likely too high",
          initial_max_abs, now, o.learning_rate);
    }
    const std::string message =
        fmt::format("step {}{}: {} NaN or infinite values; the first non-finite tensor is {}{}", step,
                    run.micro > 1 ? fmt::format(" (micro-batch {})", m + 1) : "", what, where, cause);
    if (skipped_steps >= o.skip_nonfinite_steps)
      throw std::runtime_error(fmt::format(
          "{}{}", message, o.skip_nonfinite_steps ? fmt::format(" ({} steps skipped before)", skipped_steps) : ""));
    ++skipped_steps;
    clear_live_line();
    fmt::print(progress, "{}: skipped ({} of --skip-nonfinite-steps {})\n", message, skipped_steps,
               o.skip_nonfinite_steps);
    std::fflush(progress);
    return false;
  }
  bool finite(TensorId t) {  // fp32 tensors without allocating (the guard runs in every step)
    ex.download(t);
    return ex.element_size(t) == sizeof(float) ? all_finite(ex.tensor<float>(t)) : all_finite(ex.values(t));
  }
  float max_abs_param() {
    ex.download(plan.params());
    float m = 0;
    for (float v : ex.tensor<float>(plan.params())) m = std::max(m, std::abs(v));
    return m;
  }
  // Progress: a line every --logging-steps and at the last step (with --logging-dir, an entry of
  // log_history too), with the time since the first step and the time left at the mean step time so
  // far; on a terminal also a live line, rewritten after every step (at most ten times a second).
  void log(long step) {
    const long done = step - summary.first_step + 1;
    const double elapsed = seconds_since(started), left = summary.train_seconds / done * (summary.max_steps - step);
    if (step % o.logging_steps == 0 || step == summary.max_steps) {
      const StepMetrics window{step,
                               epoch(step),
                               window_loss / window_steps,
                               lr,
                               double(window_correct) / double(window_rows),
                               window_ms / window_steps,
                               double(window_rows) / (window_ms / 1000)};
      clear_live_line();
      fmt::print(progress,
                 "step {:>5}/{} | epoch {:5.2f} | loss {:.4f} | train acc {:5.1f}% | lr {:.2e} | {:.0f} samples/s | "
                 "elapsed {} | left {}\n",
                 step, summary.max_steps, window.epoch, window.loss, 100 * window.train_accuracy, lr,
                 double(done) * run.batch * run.micro * ranks.size / summary.train_seconds, clock_text(elapsed),
                 clock_text(left));
      std::fflush(progress);
      if (metrics) metrics->logged(window);
      window_loss = window_ms = 0;
      window_correct = window_rows = window_steps = 0;
    }
    if (live && step < summary.max_steps) live_line(step, done, elapsed, left);
  }
  // step/max, loss, tokens/s (rows/s: samples/s for a model of one row per sample), the planned and
  // the measured peak, elapsed and time left; cut to the terminal's width so that \r rewrites it.
  void live_line(long step, long done, double elapsed, double left) {
    const auto now = std::chrono::steady_clock::now();
    if (live_shown && now - live_at < std::chrono::milliseconds(100)) return;
    live_at = now;
    const bool tokens = info.model.rows_per_sample() > 1;
    std::string line = fmt::format(
        "step {}/{} | loss {:.4f} | {:.0f} {}/s | memory {} planned, {} measured | elapsed {} | left {}", step,
        summary.max_steps, last.loss, double(done) * plan.rows * run.micro * ranks.size / summary.train_seconds,
        tokens ? "tokens" : "samples", mib(plan.peak_bytes), mib(summary.measured_peak), clock_text(elapsed),
        clock_text(left));
    if (const int columns = terminal_columns(progress); columns > 1 && int(line.size()) >= columns)
      line.resize(columns - 1);
    fmt::print(progress, "\r\033[K{}", line);
    std::fflush(progress);
    live_shown = true;
  }
  // Before a line that stays: the live line goes.
  void clear_live_line() {
    if (!live_shown) return;
    fmt::print(progress, "\r\033[K");
    live_shown = false;
  }
  double epoch(long step) const { return double(step) / double(std::max(1L, steps_per_epoch)); }
  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  MetricsLog::Setup metrics_setup() const {
    return {.max_steps = max_steps,
            .num_train_epochs = (max_steps + steps_per_epoch - 1) / std::max(1L, steps_per_epoch),
            .save_steps = o.save_steps,
            .logging_steps = o.logging_steps,
            .eval_steps = o.eval_steps,
            .train_batch_size = run.batch};
  }
  // --init-from: weights made elsewhere (or a snapshot's), with a fresh optimizer.
  void init_from() {
    try {
      if (is_transformers_folder(o.init_from))
        hf_config = load_transformers_folder(ex, plan, info, o.init_from, program);
      else
        load_weights(engine, o.init_from);
    } catch (const InputError &e) { throw InputError(fmt::format("--init-from {}", e.what())); }
    fmt::print(progress, "{}: weights from {}\n", program, o.init_from);
  }
  std::string hf_config;  // config.json of an --init-from Transformers folder, for --save-hf
  // --save-hf and --save-gradients: of a model they can write, into a folder that can be made, in one process.
  void check_transformers_flags() const {
    if (!o.save_hf.empty()) try {
        transformers_layout(info.model, plan, info.defaults.transformers, info.name);
        std::filesystem::create_directories(o.save_hf);
        check_writable((std::filesystem::path(o.save_hf) / "config.json").string(), "--save-hf");
      } catch (const std::filesystem::filesystem_error &e) {
        throw InputError(fmt::format("--save-hf {}: {}", o.save_hf, e.code().message()));
      } catch (const InputError &e) { throw InputError(fmt::format("--save-hf: {}", e.what())); }
    if (!o.save_gradients.empty() && ranks.size > 1)
      throw InputError("--save-gradients: one process writes its gradients (run it without mpirun)");
  }
  void save_hf(const std::string &dir) {
    try {
      save_transformers_folder(ex, plan, info, dir, o.save_hf_dtype == "bf16", hf_config);
    } catch (const InputError &e) { throw InputError(fmt::format("--save-hf {}", e.what())); }
  }
  // The snapshot's state, if it is one of this run (same model definition, seed and shaping flags,
  // before the last step).
  void resume() {
    SnapshotState snap;
    std::string folder;
    try {
      folder = resolve_snapshot(o.resume_from_snapshot);
      snap = load_snapshot(engine, folder);
    } catch (const InputError &e) { throw InputError(fmt::format("--resume-from-snapshot {}", e.what())); }
    const auto refuse = [&](std::string_view why) {
      return InputError(fmt::format("--resume-from-snapshot {}: {}", folder, why));
    };
    if (snap.model_definition != definition_digest(info.model))
      throw refuse(fmt::format("model {}'s definition (its layers or sizes) changed since the snapshot", info.name));
    if (snap.seed != o.seed)
      throw refuse(fmt::format("the snapshot was made with --seed {}, not {}", snap.seed, o.seed));
    if (snap.run != run_flags) throw refuse(fmt::format("the snapshot's run used {}", snap.run));
    if (snap.step >= summary.max_steps)
      throw refuse(fmt::format("the snapshot is at step {}, not before --max-steps {}", snap.step, summary.max_steps));
    data->restore(snap.data);  // its errors say --resume-from-snapshot
    summary.first_step = snap.step + 1;
    fmt::print(progress, "{}: resuming from {} at step {}{}\n", program, folder, snap.step,
               snap.remat_version == remat_version()
                   ? ""
                   : fmt::format(" (written by remat {}, this is {})", snap.remat_version, remat_version()));
  }
  // DIR/snapshot-<step>; then the snapshots beyond --save-total-limit, and what an interrupted save
  // left, are removed.
  // Rank 0 writes; with a sharded optimizer every rank's moments are gathered first.
  void save(long step) {
    std::vector<float> m, v;
    const Moments moments = reducer ? reducer->gather_moments(m, v) : Moments{};
    if (ranks.rank > 0) return;
    const std::string folder = (std::filesystem::path(o.output_dir) / fmt::format("snapshot-{}", step)).string();
    try {
      save_snapshot(engine, folder,
                    {.step = step,
                     .max_steps = summary.max_steps,
                     .seed = o.seed,
                     .run = run_flags,
                     .data = data->state(),
                     .model_definition = definition_digest(info.model)},
                    moments);
      remove_old_snapshots(o.output_dir, o.save_total_limit > 0 ? o.save_total_limit : INT_MAX);
    } catch (const InputError &e) { throw InputError(fmt::format("--output-dir: {}", e.what())); }
    if (!o.save_hf.empty() && step < summary.max_steps)
      save_hf((std::filesystem::path(o.save_hf) / fmt::format("step-{}", step)).string());
  }
  // --save-initial: what another implementation needs to repeat the run's first steps.
  std::map<std::string, std::string> initial_metadata() const {
    return {{"model", std::string(info.name)},
            {"policy", run.policy_label},
            {"precision", std::string(precision_name(run.precision))},
            {"step", std::to_string(summary.first_step)},
            {"seed", std::to_string(o.seed)},
            {"run", run_flags},
            {"max_steps", std::to_string(summary.max_steps)},
            {"learning_rate", fmt::format("{}", o.learning_rate)},
            {"lr_scheduler_type", o.lr_scheduler_type},
            {"warmup_steps", std::to_string(o.warmup_steps)},
            {"weight_decay", fmt::format("{}", o.weight_decay)},
            {"dropout", fmt::format("{}", o.dropout)},
            {"beta1", fmt::format("{}", scalars.beta1)},
            {"beta2", fmt::format("{}", scalars.beta2)},
            {"eps", fmt::format("{}", scalars.eps)}};
  }

  static long checked_steps_per_epoch(const DataSource &data, const Run &run) {
    const int n = Ranks::world().size;
    const long per_step = long(run.batch) * run.micro * n;
    if (per_step * long(run.plan.rows / run.batch) > INT32_MAX)
      throw InputError(fmt::format("{} rows per optimizer step: at most {} (the dropout row counter is 32-bit)",
                                   per_step * long(run.plan.rows / run.batch), INT32_MAX));
    if (per_step > data.train_samples())
      throw InputError(
          fmt::format("--batch-size {} x --gradient-accumulation-steps {}{} exceeds the {} training samples", run.batch,
                      run.micro, n > 1 ? fmt::format(" x {} ranks", n) : "", data.train_samples()));
    return data.train_samples() / per_step;
  }
  static long checked_max_steps(const Options &o, long steps_per_epoch) {
    const long steps = o.max_steps ? o.max_steps : o.num_train_epochs * steps_per_epoch;
    if (steps > INT32_MAX)
      throw InputError(fmt::format("{} steps: at most {} (the dropout counters are 32-bit)", steps, INT32_MAX));
    return steps;
  }

  const Ranks &ranks = Ranks::world();
  const Options &o;
  const ModelInfo &info;
  const Run &run;
  const Plan &plan;
  const std::string &program;
  OutputDirLock output_lock;  // --output-dir, first of all
  std::FILE *progress;
  std::unique_ptr<DataSource> data;
  // checked before the engine allocates anything
  long steps_per_epoch, max_steps;
  std::unique_ptr<MemoryTimeline> timeline;  // --memory-timeline: records the first step
  std::unique_ptr<MetricsLog> metrics;       // --logging-dir
  Engine engine;
  Executor &ex;
  Scalars &scalars;
  std::unique_ptr<GradientReducer> reducer;  // with ranks
  long eval_samples = 0;
  std::string run_flags;
  float initial_max_abs = 0;   // of the parameters as initialized (the guard's reference)
  int skipped_steps = 0;       // --skip-nonfinite-steps
  long terminating_ranks = 0;  // with ranks: those that had a SIGTERM at the last step's sums
  Summary summary;
  double lr = 0, loss_total = 0;  // the last step's learning rate; the sum of this run's step losses
  StepMetrics last;               // the last step's
  // since the last progress line
  double window_loss = 0, window_ms = 0;
  long window_correct = 0, window_rows = 0, window_steps = 0;
  // the progress stream is a terminal (a live line), which shows one now; when the loop started
  bool live = false, live_shown = false;
  std::chrono::steady_clock::time_point started, live_at;
};

}  // namespace

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

Summary train(const Options &o, const ModelInfo &info, const Run &run, const std::string &program) {
  if (run.device == Device::cuda) check_cuda(info, std::max(run.plan.peak_bytes, run.plan.eval_peak_bytes));
  return Training(o, info, run, program).train();
}

}  // namespace remat::runtime
