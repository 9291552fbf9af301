// The Engine: construction, parameter init, snapshots.
//
// A snapshot file: the line "remat-snapshot 1", one line of JSON (model, parameter count, step,
// seed, run flags, data stream state, byte order), then the parameters, the AdamW first and
// second moments as raw float32.
module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>
module remat.runtime;
import remat;

namespace remat::runtime {
namespace {
static_assert(std::endian::native == std::endian::little, "snapshots store little-endian float32");
constexpr std::string_view magic = "remat-snapshot 1";
// What a snapshot holds, in its order: the parameters, the AdamW moments.
std::array<TensorId, 3> state_tensors(const Plan &plan) { return {plan.params(), plan.adam_m(), plan.adam_v()}; }
// U(-1, 1) from 53 random bits
float uniform(std::mt19937_64 &rng) { return float(double(rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }
}  // namespace

void check_writable(const std::string &path, std::string_view what) {
  if (std::filesystem::is_directory(path)) throw InputError(fmt::format("{} {}: a folder", what, path));
  const std::string probe = path + ".tmp";
  if (!std::ofstream(probe)) throw InputError(fmt::format("{} {}: cannot write", what, path));
  std::filesystem::remove(probe);
}

void write_atomically(const std::string &path, std::string_view what,
                      const std::function<void(std::ostream &)> &write) {
  const std::string tmp = path + ".tmp";
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(fmt::format("{} {}: cannot write", what, path));
    write(out);
    out.close();
    if (!out) throw InputError(fmt::format("{} {}: write failed", what, path));
    std::filesystem::rename(tmp, path);
  } catch (const std::filesystem::filesystem_error &e) {
    std::filesystem::remove(tmp);
    throw InputError(fmt::format("{} {}: {}", what, path, e.code().message()));
  } catch (...) {
    std::filesystem::remove(tmp);
    throw;
  }
}

namespace {
Arena &with_canary(Arena &arena, bool canary) {
  if (canary) arena.fill_canary();
  return arena;
}
}  // namespace

Engine::Engine(Plan p, std::string_view name, std::span<const Kernel> kernels, Options options)
    : model_name(name),
      plan(std::move(p)),
      arena(std::max(plan.peak_bytes, plan.eval_peak_bytes), options.device),
      executor(plan, model_name, kernels, with_canary(arena, options.canary), scalars, options.checks) {}

void Engine::init_params(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const TensorId flat[] = {plan.params(), plan.grads(), plan.adam_m(), plan.adam_v()};
  for (TensorId t : flat) std::ranges::fill(executor.tensor<float>(t), 0.f);
  for (int i = 0; i < int(plan.tensors.size()); ++i) {
    const Tensor &t = plan.tensors[i];
    if (t.role != Role::params || t.key.layer < 0) continue;  // a layer's parameter (not a flat range)
    auto values = executor.tensor<float>(TensorId{i});
    switch (t.init) {
    case Init::uniform_fan_in: {
      const float bound = 1.f / std::sqrt(float(t.extent[1]));
      for (float &v : values) v = bound * uniform(rng);
      break;
    }
    case Init::ones: std::ranges::fill(values, 1.f); break;
    case Init::zeros: break;
    }
  }
  for (TensorId t : flat) executor.upload(t);
}

void Engine::save(const std::string &path, const SnapshotState &state) {
  write_atomically(path, "snapshot", [&](std::ostream &out) {
    const nlohmann::json header = {{"model", std::string(model_name)},
                                   {"param_count", plan.param_count},
                                   {"step", state.step},
                                   {"seed", state.seed},
                                   {"run", state.run},
                                   {"data", state.data},
                                   {"byte_order", "little"}};
    out << magic << '\n' << header.dump() << '\n';
    for (TensorId t : state_tensors(plan)) {
      executor.download(t);
      const auto values = executor.tensor<float>(t);
      out.write(reinterpret_cast<const char *>(values.data()), std::streamsize(values.size_bytes()));
    }
  });
}

SnapshotState Engine::load(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("snapshot {}: no such file", path));
  std::string line;
  if (!std::getline(in, line) || line != magic)
    throw InputError(fmt::format("snapshot {}: not a remat snapshot", path));
  SnapshotState state;
  nlohmann::json header;
  try {
    std::getline(in, line);
    header = nlohmann::json::parse(line);
    if (header.at("model").get<std::string>() != model_name ||
        header.at("param_count").get<long long>() != plan.param_count)
      throw InputError(fmt::format("snapshot {}: a snapshot of model {} with {} parameters; this is {} with {}", path,
                                   header.at("model").get<std::string>(), header.at("param_count").get<long long>(),
                                   model_name, plan.param_count));
    state = {header.at("step").get<long>(), header.at("seed").get<std::uint64_t>(), header.at("run").get<std::string>(),
             header.at("data").get<std::string>()};
    if (header.at("byte_order").get<std::string>() != "little")
      throw nlohmann::json::other_error::create(501, "", nullptr);
  } catch (const nlohmann::json::exception &) { throw InputError(fmt::format("snapshot {}: corrupt header", path)); }
  if (state.step < 1) throw InputError(fmt::format("snapshot {}: corrupt header (step {})", path, state.step));
  for (TensorId t : state_tensors(plan)) {
    auto values = executor.tensor<float>(t);
    if (!in.read(reinterpret_cast<char *>(values.data()), std::streamsize(values.size_bytes())))
      throw InputError(fmt::format("snapshot {}: truncated", path));
    executor.upload(t);
  }
  if (in.peek() != std::ifstream::traits_type::eof())
    throw InputError(fmt::format("snapshot {}: trailing bytes after the parameters", path));
  return state;
}

}  // namespace remat::runtime
