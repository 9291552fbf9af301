// --save-initial: the parameters and the first batch as a safetensors file, for repeating a run's
// first steps in another implementation.
module;
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {

// The parameters as model.safetensors holds them (named_parameters), then "inputs" and "labels".
void save_initial(const std::string &path, const Model &model, const Plan &plan, Executor &ex,
                  const std::map<std::string, std::string> &metadata) {
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<float>> values;
  std::vector<std::span<const std::byte>> data;
  ex.download(plan.params());
  for (const NamedParameter &p : named_parameters(plan)) {
    tensors.push_back({.name = p.name, .dtype = "F32", .shape = p.shape});
    values.push_back(to_file_layout(p, ex.tensor<float>(p.id)));
  }
  ex.download(plan.inputs());
  ex.download(plan.labels());
  const long long batch = plan.batch, per_sample = model.rows_per_sample();
  const std::vector<long long> rows = per_sample > 1 ? std::vector{batch, per_sample} : std::vector{batch};
  if (model.token_input()) {
    tensors.push_back({.name = "inputs", .dtype = "I32", .shape = rows});
  } else {  // the stored inputs as fp32 (bf16 plans store them rounded)
    tensors.push_back({.name = "inputs", .dtype = "F32", .shape = {batch, model.input.width}});
    values.push_back(ex.values(plan.inputs()));
  }
  tensors.push_back({.name = "labels", .dtype = "I32", .shape = rows});
  for (const auto &v : values) data.push_back(std::as_bytes(std::span(v)));
  if (model.token_input()) data.push_back(std::as_bytes(ex.tensor<std::int32_t>(plan.inputs())));
  data.push_back(std::as_bytes(ex.tensor<std::int32_t>(plan.labels())));
  auto meta = metadata;
  meta["format"] = "pt";
  write_safetensors(path, "--save-initial", meta, tensors, data);
}

}  // namespace remat::runtime
