module;
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>
module remat.runtime;
import remat;

// Files the trainer writes: snapshots and the --save-initial safetensors file. Both are written
// to <path>.tmp and renamed, so neither is ever half-written.
//
// A snapshot file: the line "remat-snapshot 1", one line of JSON (model, parameter count, step,
// seed, data stream state), then the parameters, the AdamW first and second moments as raw
// float32.
namespace remat::runtime {
namespace {
static_assert(std::endian::native == std::endian::little, "snapshots store little-endian float32");
constexpr std::string_view magic = "remat-snapshot 1";
constexpr const char *state_tensors[] = {"params", "adam_m", "adam_v"};

// Runs write(out) on <path>.tmp, then renames it to path; errors are one line naming the flag.
template <class Write> void write_renamed(const std::string &path, std::string_view flag, Write write) {
  const std::string tmp = path + ".tmp";
  try {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(fmt::format("{} {}: cannot write", flag, path));
    write(out);
    out.close();
    if (!out) throw InputError(fmt::format("{} {}: write failed", flag, path));
    std::filesystem::rename(tmp, path);
  } catch (const std::filesystem::filesystem_error &e) {
    std::filesystem::remove(tmp);
    throw InputError(fmt::format("{} {}: {}", flag, path, e.code().message()));
  } catch (...) {
    std::filesystem::remove(tmp);
    throw;
  }
}
}  // namespace

void save_snapshot(const std::string &path, std::string_view model_name, const Plan &plan, Executor &ex,
                   const SnapshotState &state) {
  write_renamed(path, "--save-snapshot", [&](std::ofstream &out) {
    const nlohmann::json header = {{"model", std::string(model_name)}, {"param_count", plan.param_count},
                                   {"step", state.step}, {"seed", state.seed}, {"run", state.run},
                                   {"data", state.data}, {"byte_order", "little"}};
    out << magic << '\n' << header.dump() << '\n';
    for (const char *name : state_tensors) {
      ex.download(name);
      const auto values = ex.tensor<float>(name);
      out.write(reinterpret_cast<const char *>(values.data()), std::streamsize(values.size_bytes()));
    }
  });
}

// safetensors: an 8-byte little-endian header length, the JSON header {name: {dtype, shape,
// data_offsets: [begin, end)}, "__metadata__": {string: string}} padded with spaces to a multiple
// of 8 bytes, then the tensors' little-endian data back to back.
void save_initial(const std::string &path, const Model &model, const Plan &plan, Executor &ex,
                  const std::map<std::string, std::string> &metadata) {
  struct Entry {
    std::string name, dtype;
    std::vector<long long> shape;
    std::span<const std::byte> data;
  };
  std::vector<Entry> entries;
  ex.download("params");
  for (const Tensor &t : plan.tensors) {  // the per-layer parameter views (not AdamW's flat ranges)
    if (t.role != Role::params || t.view_of < 0 || t.name.view().find('.') == std::string_view::npos) continue;
    std::vector<long long> shape = {t.extent[0]};
    if (t.dims == 2) shape = {t.extent[1], t.extent[0]};  // [rows, contiguous]
    entries.push_back({std::string(t.name.view()), "F32", shape, std::as_bytes(ex.tensor<float>(t.name.view()))});
  }
  ex.download("inputs");
  ex.download("labels");
  const long long batch = plan.batch, per_sample = model.rows_per_sample();
  const std::vector<long long> rows = per_sample > 1 ? std::vector{batch, per_sample} : std::vector{batch};
  std::vector<float> pixels;  // the stored inputs as fp32 (bf16 plans store them rounded)
  if (model.token_input()) {
    entries.push_back({"inputs", "I32", rows, std::as_bytes(ex.tensor<std::int32_t>("inputs"))});
  } else {
    pixels = ex.values("inputs");
    entries.push_back({"inputs", "F32", {batch, model.input.width}, std::as_bytes(std::span(pixels))});
  }
  entries.push_back({"labels", "I32", rows, std::as_bytes(ex.tensor<std::int32_t>("labels"))});

  nlohmann::json header = {{"__metadata__", metadata}};
  std::size_t at = 0;
  for (const Entry &e : entries) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {at, at + e.data.size()}}};
    at += e.data.size();
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  write_renamed(path, "--save-initial", [&](std::ofstream &out) {
    const std::uint64_t length = text.size();
    out.write(reinterpret_cast<const char *>(&length), 8);
    out << text;
    for (const Entry &e : entries) out.write(reinterpret_cast<const char *>(e.data.data()), std::streamsize(e.data.size()));
  });
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
