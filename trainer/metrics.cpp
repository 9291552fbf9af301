// --logging-dir: the run's metrics for later plotting. metrics.jsonl gets one JSON object per
// optimizer step as it happens (flushed, so a running or killed run's steps are there);
// trainer_state.json, written at the end, has the shape of Hugging Face's Trainer state, so the
// scripts that read an HF run's log_history (step, loss, eval_loss) read a remat run too.
module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
module remat.trainer;
import remat;

namespace remat::runtime {

struct MetricsLog::State {
  std::filesystem::path dir;
  Setup setup;
  std::ofstream jsonl;
  nlohmann::json log_history = nlohmann::json::array();
};

MetricsLog::MetricsLog(const std::string &dir, Setup setup) : state(std::make_unique<State>()) {
  state->dir = dir;
  state->setup = setup;
  std::error_code ec;
  std::filesystem::create_directories(state->dir, ec);
  if (ec) throw InputError(fmt::format("--logging-dir {}: cannot create the folder ({})", dir, ec.message()));
  const std::filesystem::path jsonl = state->dir / "metrics.jsonl";
  state->jsonl.open(jsonl, std::ios::trunc);
  if (!state->jsonl)
    throw InputError(fmt::format("--logging-dir {}: cannot write {} ({})", dir, jsonl.string(), std::strerror(errno)));
  // trainer_state.json is written at the end: fail now, not after training, if it could not be
  check_writable((state->dir / "trainer_state.json").string(), "--logging-dir");
}

MetricsLog::~MetricsLog() = default;

void MetricsLog::step(const StepMetrics &m, const std::optional<Evaluation> &eval) {
  nlohmann::json line = {{"step", m.step},
                         {"epoch", m.epoch},
                         {"loss", m.loss},
                         {"learning_rate", m.learning_rate},
                         {"step_ms", m.step_ms},
                         {"tokens_per_s", m.tokens_per_s},
                         {"train_accuracy", m.train_accuracy}};
  if (eval) {
    line["eval_loss"] = eval->loss;
    line["eval_accuracy"] = eval->accuracy;
    state->log_history.push_back({{"step", m.step},
                                  {"epoch", m.epoch},
                                  {"eval_loss", eval->loss},
                                  {"eval_accuracy", eval->accuracy},
                                  {"eval_samples", eval->samples}});
  }
  state->jsonl << line.dump() << '\n';
  state->jsonl.flush();
  if (!state->jsonl)
    throw std::runtime_error(fmt::format("--logging-dir {}: writing metrics.jsonl failed", state->dir.string()));
}

void MetricsLog::logged(const StepMetrics &window) {
  state->log_history.push_back({{"step", window.step},
                                {"epoch", window.epoch},
                                {"loss", window.loss},
                                {"learning_rate", window.learning_rate},
                                {"train_accuracy", window.train_accuracy},
                                {"tokens_per_s", window.tokens_per_s}});
}

void MetricsLog::finish(long step, double epoch, double train_loss, double train_seconds, long steps, long samples) {
  const Setup &s = state->setup;
  state->log_history.push_back({{"step", step},
                                {"epoch", epoch},
                                {"train_loss", train_loss},
                                {"train_runtime", train_seconds},
                                {"train_samples_per_second", samples / train_seconds},
                                {"train_steps_per_second", steps / train_seconds}});
  // TrainerState's fields only (transformers/trainer_callback.py), sorted and indented as Trainer
  // writes them
  const nlohmann::json trainer_state = {{"best_metric", nullptr},
                                        {"best_model_checkpoint", nullptr},
                                        {"epoch", epoch},
                                        {"eval_steps", s.eval_steps},
                                        {"global_step", step},
                                        {"is_hyper_param_search", false},
                                        {"is_local_process_zero", true},
                                        {"is_world_process_zero", true},
                                        {"log_history", state->log_history},
                                        {"logging_steps", s.logging_steps},
                                        {"max_steps", s.max_steps},
                                        {"num_train_epochs", s.num_train_epochs},
                                        {"save_steps", s.save_steps},
                                        {"train_batch_size", s.train_batch_size}};
  write_atomically((state->dir / "trainer_state.json").string(), "--logging-dir",
                   [&](std::ostream &out) { out << trainer_state.dump(2) << '\n'; });
}

}  // namespace remat::runtime
