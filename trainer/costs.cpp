// Kernel costs for the budget planner: the table --calibrate measures and later runs read (a JSON
// file keyed by machine, then by model / precision / batch / device), and the step times of plans
// measured on this machine (--plan-report --sweep --calibrate).
module;
#include "cuda_device.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {

std::string machine_name(Device device) {
  if (device == Device::cuda) {
    const cuda::DeviceInfo d = cuda::probe();
    return d.error.empty() ? "GPU " + d.name : "GPU ?";
  }
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("model name")) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return "CPU " + line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "CPU ?";
}

std::string default_cost_table() {
  if (const char *cache = std::getenv("XDG_CACHE_HOME"); cache && *cache)
    return std::string(cache) + "/remat/costs.json";
  if (const char *home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/remat/costs.json";
  return "remat-costs.json";
}

std::string cost_key(std::string_view model, Precision precision, int batch, Device device) {
  return fmt::format("{}/{}/batch{}/{}", model, precision_name(precision), batch,
                     device == Device::cuda ? "cuda" : "cpu");
}

namespace {
nlohmann::json read_table(const std::string &path) {
  std::ifstream in(path);
  if (!in) return nlohmann::json::object();
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    if (!j.is_object()) throw InputError(fmt::format("cost table {}: not a JSON object", path));
    return j;
  } catch (const nlohmann::json::exception &e) { throw InputError(fmt::format("cost table {}: {}", path, e.what())); }
}

// A kernel's variant and precision as the table writes them (their names).
template <class Enum, std::size_t N>
std::optional<Enum> named(const std::array<Enum, N> &all, std::string_view (*name)(Enum), const std::string &text) {
  for (Enum e : all)
    if (name(e) == text) return e;
  return std::nullopt;
}
constexpr std::array variants = {Variant::forward_save,
                                 Variant::forward_selective,
                                 Variant::forward_discard,
                                 Variant::backward_saved,
                                 Variant::backward_selective,
                                 Variant::backward_recompute,
                                 Variant::loss,
                                 Variant::adamw};
constexpr std::array precisions = {Precision::fp32, Precision::bf16};
static_assert(variants.size() == std::size_t(Variant::adamw) + 1 && variants.back() == Variant::adamw,
              "every Variant, in order");
}  // namespace

// An entry is a list of {"stage", "variant", "precision", "seconds"}; one of an older remat (an
// object by kernel name) counts as absent: the costs are estimated until --calibrate replaces it.
std::optional<CostModel> load_costs(const std::string &path, const std::string &machine, const std::string &key) {
  const nlohmann::json table = read_table(path);
  if (!table.contains(machine) || !table[machine].contains(key) || !table[machine][key].is_array()) return std::nullopt;
  CostModel costs;
  try {
    for (const nlohmann::json &k : table[machine][key]) {
      const auto variant = named<Variant>(variants, variant_name, k.at("variant").get<std::string>());
      const auto precision = named<Precision>(precisions, precision_name, k.at("precision").get<std::string>());
      const double seconds = k.at("seconds").get<double>();
      if (!variant || !precision || !(seconds >= 0))
        throw InputError(fmt::format("cost table {}: {} / {} holds an entry that is no kernel's time: {}", path,
                                     machine, key, k.dump()));
      costs.measured.push_back({kernel_key(k.at("stage").get<int>(), *variant, *precision), seconds});
    }
  } catch (const nlohmann::json::exception &e) { throw InputError(fmt::format("cost table {}: {}", path, e.what())); }
  return costs;
}

void save_costs(const std::string &path, const std::string &machine, const std::string &key, const CostModel &costs) {
  nlohmann::json table = read_table(path);
  nlohmann::json entry = nlohmann::json::array();
  for (const KernelTime &k : costs.measured)
    entry.push_back({{"stage", k.kernel.stage},
                     {"variant", variant_name(k.kernel.variant)},
                     {"precision", precision_name(k.kernel.precision)},
                     {"seconds", k.seconds}});
  table[machine][key] = entry;
  std::filesystem::create_directories(
      std::filesystem::path(path).parent_path().empty() ? "." : std::filesystem::path(path).parent_path());
  write_atomically(path, "cost table", [&](std::ostream &out) { out << table.dump(2) << "\n"; });
}

std::unique_ptr<Engine> engine_for_timing(Plan plan, const ModelInfo &info, Device device, DataSource &data) {
  auto engine =
      std::make_unique<Engine>(std::move(plan), info.name, device == Device::cuda ? info.cuda_kernels : info.kernels,
                               Engine::Options{.device = device});
  engine->init_params(1);
  engine->scalars.grad_scale = float(1.0 / double(engine->plan.rows));
  data.next_train_batch(engine->executor);
  return engine;
}

std::string block_calls(const Plan &plan, const Unit &unit) {
  std::string calls;
  for (const Step &st : plan.train)
    if (st.stage == unit.stage && st.block == unit.block && st.variant != Variant::loss &&
        st.variant != Variant::adamw) {
      // a forward that copies its input (a checkpoint) out to host memory: "(offloads input)"
      const bool offloads_input = std::ranges::any_of(st.offload, [&](int t) {
        return std::ranges::any_of(st.args, [&](const Arg &a) { return a.tensor == t && a.access == Access::read; });
      });
      calls += fmt::format("{}{}{}{}", calls.empty() ? "" : ", ", variant_name(st.variant), st.recompute ? "*" : "",
                           offloads_input ? " (offloads input)" : "");
    }
  return calls;
}

namespace {
// Runs `plan` on data from `data`: one untimed micro-batch, then timed ones (and as many
// evaluations): three, or one where the untimed one took over two seconds (a model at full size,
// whose repeat stages still give a call a block); returns the engine, whose executor holds the
// call times, and the timed micro-batches.
std::pair<std::unique_ptr<Engine>, int> timed_engine(const Plan &plan, const ModelInfo &info, Device device,
                                                     DataSource &data) {
  auto engine = engine_for_timing(plan, info, device, data);
  const auto t0 = std::chrono::steady_clock::now();
  engine->train();
  engine->evaluate();
  engine->arena.synchronize();
  const int runs = std::chrono::steady_clock::now() - t0 > std::chrono::seconds(2) ? 1 : 3;
  engine->executor.time_calls = true;
  for (int r = 0; r < runs; ++r) {
    engine->train();
    engine->evaluate();
  }
  engine->arena.synchronize();
  return {std::move(engine), runs};
}
}  // namespace

CostModel calibrate(const ModelInfo &info, Device device, Precision precision, int batch, DataSource &data) {
  const Model &m = info.model;
  std::map<KernelKey, std::vector<double>> per_call;  // seconds of each call, by kernel
  // none, selective and full run every block kernel of the repeat stages; the evaluation runs
  // every stage's forward_discard
  for (const Policy &p : {none, selective, full}) {
    const Plan plan = make_plan(m, p, batch, precision);
    const auto [engine, runs] = timed_engine(plan, info, device, data);
    for (auto [phase, steps] : {std::pair{Executor::Phase::train, &plan.train}, {Executor::Phase::eval, &plan.eval}}) {
      const std::vector<double> seconds = engine->executor.call_seconds(phase);
      for (std::size_t i = 0; i < steps->size(); ++i) {
        const Step &st = (*steps)[i];
        per_call[kernel_key(st.stage, st.variant, precision)].push_back(seconds[i] / runs);
      }
    }
  }
  CostModel costs;
  for (auto &[kernel, calls] : per_call) {
    std::ranges::sort(calls);
    costs.measured.push_back({kernel, calls[calls.size() / 2]});
  }
  return costs;
}

double measured_step_ms(const Plan &plan, const ModelInfo &info, Device device, DataSource &data) {
  auto engine = engine_for_timing(plan, info, device, data);
  std::vector<double> ms;
  for (int r = 0; r < 6; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    engine->train();
    engine->arena.synchronize();
    if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::ranges::sort(ms);
  return ms[ms.size() / 2];
}

}  // namespace remat::runtime
