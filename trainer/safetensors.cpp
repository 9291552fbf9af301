// --save-initial: the parameters and the first batch as a safetensors file, for repeating a run's
// first steps in another implementation; its metadata "remat.model" describes the model (JSON).
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

namespace {
// The model as the user wrote it: its input, its stages (each a layer list, repeated), the
// classes. A layer's parameters are stages.<s>.blocks.<b>.layers.<index in "layers">.<name>.
nlohmann::json model_description(const Model &model) {
  nlohmann::json stages = nlohmann::json::array();
  for (int s = 0; s < model.n_stages; ++s) {
    const Block &b = model.stages[s];
    nlohmann::json layers = nlohmann::json::array();
    for (int k = 0; k < b.n_layers; ++k) {
      const Layer &l = b.layers[k];
      nlohmann::json j = {{"kind", kind(l.op).name}, {"in", l.in}, {"out", l.out}, {"bias", l.bias}};
      if (l.heads) j.update({{"heads", l.heads}, {"kv_heads", l.kv_heads}});
      if (l.vocab) j.update({{"vocab", l.vocab}, {"block_size", l.block_size}});
      if (l.eps) j["eps"] = l.eps;
      if (l.rope_theta) j["rope_theta"] = l.rope_theta;
      if (const auto &r = l.rope_scaling; r.enabled())
        j["rope_llama3"] = {{"factor", r.factor},
                            {"low_freq_factor", r.low_freq_factor},
                            {"high_freq_factor", r.high_freq_factor},
                            {"original_max_position_embeddings", r.original_context}};
      if (l.op == Op::gelu) j["exact"] = l.gelu_exact;
      if (l.tied()) j["tied_to"] = {{"stage", l.tie_stage}, {"layer", l.tie_layer}};
      layers.push_back(std::move(j));
    }
    stages.push_back({{"repeat", b.repeat}, {"layers", std::move(layers)}});
  }
  return {
      {"input", {{"width", model.input.width}, {"vocab", model.input.vocab}, {"block_size", model.input.block_size}}},
      {"stages", std::move(stages)},
      {"classes", model.classes()}};
}
}  // namespace

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
  meta["remat.model"] = model_description(model).dump();
  write_safetensors(path, "--save-initial", meta, tensors, data);
}

}  // namespace remat::runtime
