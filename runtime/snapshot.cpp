module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <bit>
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
static_assert(std::endian::native == std::endian::little, "snapshots store little-endian float32");
constexpr std::string_view magic = "remat-snapshot 1";
constexpr const char *state_tensors[] = {"params", "adam_m", "adam_v"};
}  // namespace

void save_snapshot(const std::string &path, std::string_view model_name, const Plan &plan, Executor &ex,
                   const SnapshotState &state) {
  const std::string tmp = path + ".tmp";
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(fmt::format("--save-snapshot {}: cannot write", path));
    const nlohmann::json header = {{"model", std::string(model_name)}, {"param_count", plan.param_count},
                                   {"step", state.step}, {"seed", state.seed}, {"run", state.run},
                                   {"data", state.data}, {"byte_order", "little"}};
    out << magic << '\n' << header.dump() << '\n';
    for (const char *name : state_tensors) {
      ex.download(name);
      const auto values = ex.tensor<float>(name);
      out.write(reinterpret_cast<const char *>(values.data()), std::streamsize(values.size_bytes()));
    }
    out.close();
    if (!out) throw InputError(fmt::format("--save-snapshot {}: write failed", path));
    std::filesystem::rename(tmp, path);
  } catch (const std::filesystem::filesystem_error &e) {
    std::filesystem::remove(tmp);
    throw InputError(fmt::format("--save-snapshot {}: {}", path, e.code().message()));
  } catch (...) {
    std::filesystem::remove(tmp);
    throw;
  }
}

SnapshotState load_snapshot(const std::string &path, std::string_view model_name, const Plan &plan, Executor &ex) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("--resume-from-snapshot {}: no such file", path));
  std::string line;
  if (!std::getline(in, line) || line != magic)
    throw InputError(fmt::format("--resume-from-snapshot {}: not a remat snapshot", path));
  SnapshotState state;
  nlohmann::json header;
  try {
    std::getline(in, line);
    header = nlohmann::json::parse(line);
    if (header.at("model").get<std::string>() != model_name || header.at("param_count").get<long long>() != plan.param_count)
      throw InputError(fmt::format("--resume-from-snapshot {}: a snapshot of model {} with {} parameters; this is {} with {}",
                                   path, header.at("model").get<std::string>(), header.at("param_count").get<long long>(),
                                   model_name, plan.param_count));
    state = {header.at("step").get<long>(), header.at("seed").get<std::uint64_t>(), header.at("run").get<std::string>(),
             header.at("data").get<std::string>()};
    if (header.at("byte_order").get<std::string>() != "little") throw nlohmann::json::other_error::create(501, "", nullptr);
  } catch (const nlohmann::json::exception &) {
    throw InputError(fmt::format("--resume-from-snapshot {}: corrupt header", path));
  }
  if (state.step < 1) throw InputError(fmt::format("--resume-from-snapshot {}: corrupt header (step {})", path, state.step));
  for (const char *name : state_tensors) {
    auto values = ex.tensor<float>(name);
    if (!in.read(reinterpret_cast<char *>(values.data()), std::streamsize(values.size_bytes())))
      throw InputError(fmt::format("--resume-from-snapshot {}: truncated", path));
    ex.upload(name);
  }
  if (in.peek() != std::ifstream::traits_type::eof())
    throw InputError(fmt::format("--resume-from-snapshot {}: trailing bytes after the parameters", path));
  return state;
}

}  // namespace remat::runtime
