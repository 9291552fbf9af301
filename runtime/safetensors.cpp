// --save-initial: the parameters and the first batch as a safetensors file, for repeating a run's
// first steps in another implementation.
module;
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {

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
  ex.download(plan.params());
  for (int i = 0; i < int(plan.tensors.size()); ++i) {  // the per-layer parameter views (not AdamW's flat ranges)
    const Tensor &t = plan.tensors[i];
    if (t.role != Role::params || t.key.layer < 0) continue;
    std::vector<long long> shape = {t.extent[0]};
    if (t.dims == 2) shape = {t.extent[1], t.extent[0]};  // [rows, contiguous]
    entries.push_back({std::string(name_of(t.key).view()), "F32", shape, std::as_bytes(ex.tensor<float>(TensorId{i}))});
  }
  ex.download(plan.inputs());
  ex.download(plan.labels());
  const long long batch = plan.batch, per_sample = model.rows_per_sample();
  const std::vector<long long> rows = per_sample > 1 ? std::vector{batch, per_sample} : std::vector{batch};
  std::vector<float> pixels;  // the stored inputs as fp32 (bf16 plans store them rounded)
  if (model.token_input()) {
    entries.push_back({"inputs", "I32", rows, std::as_bytes(ex.tensor<std::int32_t>(plan.inputs()))});
  } else {
    pixels = ex.values(plan.inputs());
    entries.push_back({"inputs", "F32", {batch, model.input.width}, std::as_bytes(std::span(pixels))});
  }
  entries.push_back({"labels", "I32", rows, std::as_bytes(ex.tensor<std::int32_t>(plan.labels()))});

  nlohmann::json header = {{"__metadata__", metadata}};
  std::size_t at = 0;
  for (const Entry &e : entries) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {at, at + e.data.size()}}};
    at += e.data.size();
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  write_atomically(path, "--save-initial", [&](std::ostream &out) {
    const std::uint64_t length = text.size();
    out.write(reinterpret_cast<const char *>(&length), 8);
    out << text;
    for (const Entry &e : entries)
      out.write(reinterpret_cast<const char *>(e.data.data()), std::streamsize(e.data.size()));
  });
}

}  // namespace remat::runtime
