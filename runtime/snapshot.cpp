module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
module remat.runtime;
import remat;

// A snapshot file: the line "remat-snapshot 1", one line of JSON (model, parameter count, step,
// seed, data stream state), then the parameters, the AdamW first and second moments as raw
// float32. Written to <path>.tmp and renamed, so a snapshot is never half-written.
namespace remat::runtime {
namespace {
constexpr std::string_view magic = "remat-snapshot 1";
constexpr const char *state_tensors[] = {"params", "adam_m", "adam_v"};
}  // namespace

void save_snapshot(const std::string &path, std::string_view model_name, const Plan &plan, Executor &ex,
                   const SnapshotState &state) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(fmt::format("--save-snapshot {}: cannot write", path));
    const nlohmann::json header = {{"model", std::string(model_name)}, {"param_count", plan.param_count},
                                   {"step", state.step}, {"seed", state.seed}, {"data", state.data}};
    out << magic << '\n' << header.dump() << '\n';
    for (const char *name : state_tensors) {
      const auto values = ex.tensor<float>(name);
      out.write(reinterpret_cast<const char *>(values.data()), std::streamsize(values.size_bytes()));
    }
    if (!out.flush()) throw InputError(fmt::format("--save-snapshot {}: write failed", path));
  }
  std::filesystem::rename(tmp, path);
}

SnapshotState load_snapshot(const std::string &path, std::string_view model_name, const Plan &plan, Executor &ex) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("--resume-from-snapshot {}: no such file", path));
  std::string line;
  if (!std::getline(in, line) || line != magic)
    throw InputError(fmt::format("--resume-from-snapshot {}: not a remat snapshot", path));
  nlohmann::json header;
  try {
    std::getline(in, line);
    header = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception &) {
    throw InputError(fmt::format("--resume-from-snapshot {}: corrupt header", path));
  }
  if (header.value("model", "") != model_name || header.value("param_count", -1LL) != plan.param_count)
    throw InputError(fmt::format("--resume-from-snapshot {}: a snapshot of model {} with {} parameters; this is {} with {}",
                                 path, header.value("model", "?"), header.value("param_count", -1LL), model_name,
                                 plan.param_count));
  SnapshotState state{header.value("step", 0L), header.value("seed", std::uint64_t{0}), header.value("data", "")};
  for (const char *name : state_tensors) {
    auto values = ex.tensor<float>(name);
    if (!in.read(reinterpret_cast<char *>(values.data()), std::streamsize(values.size_bytes())))
      throw InputError(fmt::format("--resume-from-snapshot {}: truncated", path));
  }
  if (in.peek() != std::ifstream::traits_type::eof())
    throw InputError(fmt::format("--resume-from-snapshot {}: trailing bytes after the parameters", path));
  return state;
}

}  // namespace remat::runtime
