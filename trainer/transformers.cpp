// Transformers model folders: config.json and model.safetensors (or the shards that
// model.safetensors.index.json lists), as save_pretrained writes them, for the models whose module
// names a Transformers architecture (TrainerDefaults::transformers: "gpt2" is GPT2LMHeadModel,
// "llama" LlamaForCausalLM). One table per architecture maps remat's parameters to Transformers'
// names and layouts, both ways (transformers_layout); config.json is checked field by field
// against the compiled model and written from it.
module;
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "bf16.h"
module remat.trainer;
import remat;

namespace remat::runtime {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {
// How a fused remat linear splits into Transformers' tensors along its output columns.
enum class Split : std::uint8_t { whole, qkv, halves };
// A layer of an architecture's block, in order (dropout and the residual markers left out): its
// kind and, for a layer with parameters, its Transformers module name(s).
struct BlockLayer {
  Op op;
  std::vector<std::string_view> names{};
  Split split = Split::whole;
};
struct Architecture {
  std::string_view name, model_type, class_name;
  std::string_view token_table, position_table, final_norm;  // full names (position: "" when none)
  std::string_view block_prefix;                             // then the block's index and "."
  std::vector<BlockLayer> block;
  Op norm;
  bool block_linears_transposed;  // nn.Linear's [out, in] (Llama); GPT-2's Conv1D keep [in, out]
  // the config fields that switch the block linears' biases, by linear (GPT-2's have biases)
  std::vector<std::string_view> bias_fields{};
};

const Architecture gpt2{.name = "gpt2",
                        .model_type = "gpt2",
                        .class_name = "GPT2LMHeadModel",
                        .token_table = "transformer.wte.weight",
                        .position_table = "transformer.wpe.weight",
                        .final_norm = "transformer.ln_f",
                        .block_prefix = "transformer.h.",
                        .block = {{Op::layer_norm, {"ln_1"}},
                                  {Op::linear, {"attn.c_attn"}},
                                  {Op::attention},
                                  {Op::linear, {"attn.c_proj"}},
                                  {Op::layer_norm, {"ln_2"}},
                                  {Op::linear, {"mlp.c_fc"}},
                                  {Op::gelu},
                                  {Op::linear, {"mlp.c_proj"}}},
                        .norm = Op::layer_norm,
                        .block_linears_transposed = false};
const Architecture llama{
    .name = "llama",
    .model_type = "llama",
    .class_name = "LlamaForCausalLM",
    .token_table = "model.embed_tokens.weight",
    .position_table = "",
    .final_norm = "model.norm",
    .block_prefix = "model.layers.",
    .block = {{Op::rms_norm, {"input_layernorm"}},
              {Op::linear, {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, Split::qkv},
              {Op::rope},
              {Op::attention},
              {Op::linear, {"self_attn.o_proj"}},
              {Op::rms_norm, {"post_attention_layernorm"}},
              {Op::linear, {"mlp.gate_proj", "mlp.up_proj"}, Split::halves},
              {Op::swiglu},
              {Op::linear, {"mlp.down_proj"}}},
    .norm = Op::rms_norm,
    .block_linears_transposed = true,
    .bias_fields = {"attention_bias", "attention_bias", "mlp_bias", "mlp_bias"}};

const Architecture &architecture_named(std::string_view name, std::string_view model) {
  if (name == gpt2.name) return gpt2;
  if (name == llama.name) return llama;
  throw InputError(name.empty()
                       ? fmt::format("model {} names no Transformers architecture (its module's "
                                     "TrainerDefaults::transformers)",
                                     model)
                       : fmt::format("model {}: no Transformers architecture \"{}\" (gpt2, llama)", model, name));
}

// The layers of stage s that are not dropout or residual markers, by index.
std::vector<int> layers_of(const Block &b) {
  std::vector<int> out;
  for (int k = 0; k < b.n_layers; ++k)
    if (b.layers[k].op != Op::dropout && b.layers[k].op != Op::residual_begin && b.layers[k].op != Op::residual_end)
      out.push_back(k);
  return out;
}

// What the compiled model is, in the terms of its architecture's config.json.
struct Shape {
  const Architecture *arch = nullptr;
  int stem = 0, blocks = 1, head = 2;  // stages
  const Layer *embedding = nullptr, *head_linear = nullptr, *final_norm = nullptr;
  const Block *block = nullptr;
  int heads = 0, kv_heads = 0, head_dim = 0, width = 0, inner = 0, layers = 0, context = 0, vocab = 0;
  double eps = 0, rope_theta = 0;
  Layer::RopeScaling rope_scaling{};
  bool tied = false, gelu_exact = false;
  std::map<std::string_view, bool> biases;  // by the Architecture's bias_fields
};

Shape shape_of(const Model &m, const Architecture &a, std::string_view model) {
  auto wrong = [&](std::string_view why) {
    return InputError(fmt::format("model {} is not a {} ({}): {}", model, a.class_name, a.name, why));
  };
  if (m.n_stages != 3 || m.stages[1].repeat < 1 || !m.stages[1].checkpointable)
    throw wrong("it needs three stages: the embedding, a repeat of blocks, the final norm and the LM head");
  Shape s;
  s.arch = &a;
  const std::vector<int> stem = layers_of(m.stages[0]), head = layers_of(m.stages[2]), block = layers_of(m.stages[1]);
  if (stem.size() != 1 || m.stages[0].layers[stem[0]].op != Op::embedding)
    throw wrong("its first stage is not one embedding");
  s.embedding = &m.stages[0].layers[stem[0]];
  if (s.embedding->bias != !a.position_table.empty())
    throw wrong(a.position_table.empty() ? "its embedding has a position table"
                                         : "its embedding has no position table");
  if (head.size() != 2 || m.stages[2].layers[head[0]].op != a.norm || m.stages[2].layers[head[1]].op != Op::linear)
    throw wrong(fmt::format("its last stage is not {} and a linear", op_name(a.norm)));
  s.final_norm = &m.stages[2].layers[head[0]];
  s.head_linear = &m.stages[2].layers[head[1]];
  if (s.head_linear->bias) throw wrong("its LM head has a bias");
  s.block = &m.stages[1];
  if (block.size() != a.block.size())
    throw wrong(fmt::format("its block has {} layers, not {}", block.size(), a.block.size()));
  std::size_t linear = 0;
  for (std::size_t i = 0; i < block.size(); ++i) {
    const Layer &l = s.block->layers[block[i]];
    if (l.op != a.block[i].op)
      throw wrong(fmt::format("layer {} of its block is {}, not {}", i, op_name(l.op), op_name(a.block[i].op)));
    if (l.op == Op::linear && a.bias_fields.empty() && !l.bias)
      throw wrong(fmt::format("linear {} of its block has no bias", i));
    if (l.op == Op::linear && !a.bias_fields.empty()) {
      const auto at = s.biases.try_emplace(a.bias_fields[linear++], l.bias).first;
      if (at->second != l.bias)
        throw wrong(fmt::format("the linears that {} switches do not agree on a bias", at->first));
    }
    if (l.op == Op::attention) s.heads = l.heads, s.kv_heads = l.kv_heads, s.head_dim = l.out / l.heads;
    if (l.op == a.norm) s.eps = l.eps;
    if (l.op == Op::gelu) s.gelu_exact = l.gelu_exact;
    if (l.op == Op::rope) s.rope_theta = l.rope_theta, s.rope_scaling = l.rope_scaling;
  }
  s.width = s.block->in();
  const int fc = block[a.name == gpt2.name ? 5 : 6];
  s.inner = a.name == gpt2.name ? s.block->layers[fc].out : s.block->layers[fc].out / 2;
  if (a.name == llama.name && s.block->layers[block[1]].out != (s.heads + 2 * s.kv_heads) * s.head_dim)
    throw wrong("its q/k/v projection's width is not (heads + 2 kv_heads) x head_dim");
  if (s.final_norm->eps != s.eps) throw wrong("its norms have different epsilons");
  s.layers = s.block->repeat;
  s.context = m.input.block_size;
  s.vocab = s.embedding->vocab;
  s.tied = s.head_linear->tied();
  return s;
}

// The config.json fields that shape the model, as the compiled model has them (json values;
// at_least: the config may say more, as max_position_embeddings), with Transformers' defaults
// for absent fields.
struct Field {
  std::string name;
  json value;
  json absent;  // what Transformers takes when the field is missing (null: required)
  bool at_least = false;
};
std::vector<Field> shape_fields(const Shape &s) {
  if (s.arch->name == gpt2.name)
    return {{"vocab_size", s.vocab, 50257},
            {"n_positions", s.context, 1024},
            {"n_embd", s.width, 768},
            {"n_layer", s.layers, 12},
            {"n_head", s.heads, 12},
            {"n_inner", s.inner, 4 * s.width},
            {"layer_norm_epsilon", s.eps, 1e-5},
            {"activation_function", s.gelu_exact ? "gelu" : "gelu_new", "gelu_new"},
            {"tie_word_embeddings", s.tied, true}};
  return {{"vocab_size", s.vocab, 32000},
          {"hidden_size", s.width, 4096},
          {"intermediate_size", s.inner, 11008},
          {"num_hidden_layers", s.layers, 32},
          {"num_attention_heads", s.heads, 32},
          {"num_key_value_heads", s.kv_heads, s.heads},
          {"head_dim", s.head_dim, s.width / s.heads},
          {"rms_norm_eps", s.eps, 1e-6},
          {"rope_theta", s.rope_theta, 10000.0},
          {"max_position_embeddings", s.context, 2048, true},
          {"hidden_act", "silu", "silu"},
          {"attention_bias", s.biases.at("attention_bias"), false},
          {"mlp_bias", s.biases.at("mlp_bias"), false},
          {"tie_word_embeddings", s.tied, false}};
}

// RoPE's rope_type and the numbers of its scaling, as rope_parameters holds them.
json rope_kind(const Shape &s) {
  const Layer::RopeScaling &r = s.rope_scaling;
  if (!r.enabled()) return {{"rope_type", "default"}};
  return {{"rope_type", "llama3"},
          {"factor", r.factor},
          {"low_freq_factor", r.low_freq_factor},
          {"high_freq_factor", r.high_freq_factor},
          {"original_max_position_embeddings", r.original_context}};
}

// A config's field, with Transformers' reading: n_inner null means 4 n_embd; Transformers 5 keeps
// rope_theta in rope_parameters.
json field_of(const json &config, const Field &f) {
  if (f.name == "rope_theta" && config.contains("rope_parameters") && config["rope_parameters"].is_object() &&
      config["rope_parameters"].contains("rope_theta"))
    return config["rope_parameters"]["rope_theta"];
  if (!config.contains(f.name) || config[f.name].is_null()) return f.absent;
  return config[f.name];
}

std::string json_text(const json &v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// Refuses a config.json that differs from the compiled model in a field that shapes it.
void check_config(const json &config, const Shape &s, const std::string &file, std::string_view program) {
  const std::string type = config.value("model_type", "");
  if (type != s.arch->model_type)
    throw InputError(
        fmt::format("{}: model_type is \"{}\", {} was built for \"{}\"", file, type, program, s.arch->model_type));
  for (const Field &f : shape_fields(s)) {
    const json given = field_of(config, f);
    const bool same =
        given.is_number() && f.value.is_number() ? given.get<double>() == f.value.get<double>() : given == f.value;
    const bool enough = f.at_least && given.is_number() && given.get<double>() >= f.value.get<double>();
    if (!same && !enough)
      throw InputError(fmt::format("{}: {} is {}, {} was built with {}{}", file, f.name, json_text(given), program,
                                   f.at_least ? "at most " : "", json_text(f.value)));
  }
  // RoPE's kind: rope_parameters (Transformers 5) or rope_scaling (before)
  json rope = json::object();
  for (const char *field : {"rope_scaling", "rope_parameters"})
    if (config.contains(field) && config[field].is_object()) rope = config[field];
  const std::string kind = rope.value("rope_type", rope.value("type", "default"));
  const json built = rope_kind(s);
  if (const std::string built_kind = built["rope_type"]; kind != built_kind)
    throw InputError(fmt::format("{}: rope_type is \"{}\", {} was built with \"{}\"", file, kind, program, built_kind));
  for (const auto &[name, value] : built.items()) {
    const json given = rope.value(name, json());
    if (name != "rope_type" && !(given.is_number() && given.get<double>() == value.get<double>()))
      throw InputError(
          fmt::format("{}: rope {} is {}, {} was built with {}", file, name, json_text(given), program, value.dump()));
  }
}

json config_of(const Shape &s, bool bf16) {
  json c;
  c["architectures"] = {std::string(s.arch->class_name)};
  c["model_type"] = s.arch->model_type;
  for (const Field &f : shape_fields(s)) c[f.name] = f.value;
  if (s.arch->name == gpt2.name) {
    for (const char *p : {"attn_pdrop", "embd_pdrop", "resid_pdrop"}) c[p] = 0.1;
    c["initializer_range"] = 0.02;
    c["scale_attn_weights"] = true;
  } else {
    c["attention_dropout"] = 0.0;
    c["initializer_range"] = 0.02;
    c.erase("rope_theta");  // Transformers 5 keeps it here
    c["rope_parameters"] = rope_kind(s);
    c["rope_parameters"]["rope_theta"] = s.rope_theta;
  }
  c["dtype"] = bf16 ? "bfloat16" : "float32";
  return c;
}

std::string table_name(const Architecture &a, int block, std::string_view module, int index) {
  return fmt::format("{}{}.{}.{}", a.block_prefix, block, module, index == 0 ? "weight" : "bias");
}
}  // namespace

TransformersLayout transformers_layout(const Model &m, const Plan &plan, std::string_view architecture,
                                       std::string_view model) {
  const Architecture &a = architecture_named(architecture, model);
  const Shape s = shape_of(m, a, model);
  TransformersLayout out{.architecture = std::string(a.class_name)};
  // parameter `index` of layer k of block b of stage st, as Transformers' tensors
  auto add = [&](int st, int b, int k, int index, std::vector<std::string> names, Split split, bool transposed) {
    const Block &blk = m.stages[st];
    const TensorId id = plan.at(key::parameter(blk, k, index).at(st, b));
    const Tensor &t = plan.tensors[std::size_t(id.index)];
    const long long cols = t.extent[0], rows = t.dims == 2 ? t.extent[1] : 1;
    std::vector<long long> widths(names.size(), cols / std::ssize(names));
    if (split == Split::qkv) {
      const long long d = cols / (s.heads + 2 * s.kv_heads);
      widths = {s.heads * d, s.kv_heads * d, s.kv_heads * d};
    }
    long long first = 0;
    for (std::size_t i = 0; i < names.size(); first += widths[i++])
      out.tensors.push_back({names[i], id, rows, cols, first, widths[i], transposed && t.dims == 2});
  };
  const int e = layers_of(m.stages[0])[0];
  add(0, 0, e, 0, {std::string(a.token_table)}, Split::whole, false);
  if (!a.position_table.empty()) add(0, 0, e, 1, {std::string(a.position_table)}, Split::whole, false);
  const std::vector<int> block = layers_of(m.stages[1]);
  for (int b = 0; b < m.stages[1].repeat; ++b)
    for (std::size_t i = 0; i < block.size(); ++i) {
      const BlockLayer &bl = a.block[i];
      if (bl.names.empty()) continue;
      const Layer &l = m.stages[1].layers[block[i]];
      for (int index = 0; index < 2; ++index) {
        if (!present(kind(l.op).params[std::size_t(index)], l)) continue;
        std::vector<std::string> names;
        for (std::string_view n : bl.names) names.push_back(table_name(a, b, n, index));
        add(1, b, block[i], index, names, bl.split, l.op == Op::linear && a.block_linears_transposed);
      }
    }
  const std::vector<int> head = layers_of(m.stages[2]);
  add(2, 0, head[0], 0, {fmt::format("{}.weight", a.final_norm)}, Split::whole, false);
  if (a.norm == Op::layer_norm) add(2, 0, head[0], 1, {fmt::format("{}.bias", a.final_norm)}, Split::whole, false);
  if (s.tied)
    out.tied_head = "lm_head.weight";
  else
    add(2, 0, head[1], 0, {"lm_head.weight"}, Split::whole, true);
  return out;
}

std::vector<long long> TransformersTensor::shape() const {
  if (rows == 1 && !linear) return {count};
  return linear ? std::vector{count, rows} : std::vector{rows, count};
}
void TransformersTensor::read(std::span<const float> file, std::span<float> param) const {
  for (long long r = 0; r < rows; ++r)
    for (long long c = 0; c < count; ++c)
      param[std::size_t(r * cols + first + c)] = file[std::size_t(linear ? c * rows + r : r * count + c)];
}
void TransformersTensor::write(std::span<const float> param, std::span<float> file) const {
  for (long long r = 0; r < rows; ++r)
    for (long long c = 0; c < count; ++c)
      file[std::size_t(linear ? c * rows + r : r * count + c)] = param[std::size_t(r * cols + first + c)];
}

bool is_transformers_folder(const std::string &path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(fs::path(path) / "config.json", ec);
}

namespace {
json read_json(const std::string &path) {
  const std::vector<std::byte> bytes = read_bytes(path);
  try {
    return json::parse(reinterpret_cast<const char *>(bytes.data()),
                       reinterpret_cast<const char *>(bytes.data()) + bytes.size());
  } catch (const json::exception &e) { throw InputError(fmt::format("{}: not JSON ({})", path, e.what())); }
}

// The tensors of a folder: model.safetensors, or the shards model.safetensors.index.json maps.
std::vector<Safetensors> read_weights(const fs::path &dir) {
  std::vector<Safetensors> files;
  const fs::path index = dir / "model.safetensors.index.json";
  std::error_code ec;
  if (!fs::exists(index, ec)) {
    files.push_back(read_safetensors((dir / "model.safetensors").string()));
    return files;
  }
  const json j = read_json(index.string());
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw InputError(fmt::format("{}: no weight_map", index.string()));
  std::set<std::string> shards;
  for (const auto &[name, file] : j["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
      throw InputError(fmt::format("{}: {} maps to no file of the folder", index.string(), name));
    shards.insert(file.get<std::string>());
  }
  for (const std::string &shard : shards) files.push_back(read_safetensors((dir / shard).string()));
  return files;
}

std::vector<std::byte> as_dtype(std::span<const float> values, bool bf16) {
  std::vector<std::byte> out(values.size() * (bf16 ? 2 : 4));
  if (!bf16) {
    std::memcpy(out.data(), values.data(), out.size());
    return out;
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint16_t h = float_to_bf16(values[i]);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}
}  // namespace

std::string load_transformers_folder(Executor &ex, const Plan &plan, const ModelInfo &info, const std::string &dir,
                                     std::string_view program) {
  const Architecture &a = architecture_named(info.defaults.transformers, info.name);
  const std::string config_file = (fs::path(dir) / "config.json").string();
  const json config = read_json(config_file);
  check_config(config, shape_of(info.model, a, info.name), config_file, program);
  const TransformersLayout layout = transformers_layout(info.model, plan, a.name, info.name);
  const std::vector<Safetensors> files = read_weights(dir);
  // GPT-2's own files name its tensors without "transformer."; its attention mask buffers are no parameters
  auto canonical = [&](const std::string &name) {
    if (a.name == gpt2.name && !name.starts_with("transformer.") && !name.starts_with("lm_head."))
      return "transformer." + name;
    return name;
  };
  std::map<std::string, std::pair<const Safetensors *, const SafetensorsTensor *>> found;
  for (const Safetensors &f : files)
    for (const SafetensorsTensor &t : f.tensors) found[canonical(t.name)] = {&f, &t};
  std::vector<std::string> bad;
  std::set<std::string> expected;
  for (const TransformersTensor &t : layout.tensors) {
    expected.insert(t.name);
    const auto it = found.find(t.name);
    if (it == found.end()) {
      bad.push_back(fmt::format("{} missing", t.name));
      continue;
    }
    const SafetensorsTensor &f = *it->second.second;
    if (f.shape != t.shape())
      bad.push_back(fmt::format("{} is [{}] in the folder, [{}] in {}", t.name, fmt::join(f.shape, ", "),
                                fmt::join(t.shape(), ", "), program));
    else if (f.dtype != "F32" && f.dtype != "BF16" && f.dtype != "F16")
      bad.push_back(fmt::format("{} is {}, not F32, BF16 or F16", t.name, f.dtype));
  }
  for (const auto &[name, where] : found) {
    const bool mask_buffer =
        a.name == gpt2.name && (name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"));
    if (!expected.contains(name) && name != layout.tied_head && !mask_buffer)
      bad.push_back(fmt::format("{} is not a tensor of {}", name, program));
  }
  if (!bad.empty())
    throw InputError(fmt::format("{}: {} mismatch{} with {}: {}", dir, bad.size(), bad.size() == 1 ? "" : "es", program,
                                 fmt::join(bad, "; ")));
  ex.download(plan.params());
  const std::span<float> params = ex.tensor<float>(plan.params());
  for (const TransformersTensor &t : layout.tensors) {
    const auto [file, tensor] = found.at(t.name);
    t.read(floats(*file, *tensor), parameter_in(params, plan, t.param));
  }
  // a tied head saved anyway (older save_pretrained) must be the token table it is tied to
  if (const auto head = found.find(layout.tied_head); !layout.tied_head.empty() && head != found.end()) {
    const TransformersTensor &table = layout.tensors.front();
    std::vector<float> values(std::size_t(table.rows * table.cols));
    table.write(parameter_in(params, plan, table.param), values);
    const std::vector<float> given = floats(*head->second.first, *head->second.second);
    if (head->second.second->shape != table.shape() || given != values)
      throw InputError(
          fmt::format("{}: {} differs from {}, but {} ties them", dir, layout.tied_head, table.name, program));
  }
  for (float v : params)
    if (!std::isfinite(v)) throw InputError(fmt::format("{}: the weights hold NaN or infinite values", dir));
  ex.upload(plan.params());
  return config.dump();
}

void save_transformers_folder(Executor &ex, const Plan &plan, const ModelInfo &info, const std::string &dir, bool bf16,
                              const std::string &source_config) {
  const Architecture &a = architecture_named(info.defaults.transformers, info.name);
  const Shape s = shape_of(info.model, a, info.name);
  const TransformersLayout layout = transformers_layout(info.model, plan, a.name, info.name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create the folder ({})", dir, ec.message()));
  ex.download(plan.params());
  const std::span<float> params = ex.tensor<float>(plan.params());
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<std::byte>> bytes;
  for (const TransformersTensor &t : layout.tensors) {
    std::vector<float> values(std::size_t(t.rows * t.count));
    t.write(parameter_in(params, plan, t.param), values);
    tensors.push_back({.name = t.name, .dtype = bf16 ? "BF16" : "F32", .shape = t.shape()});
    bytes.push_back(as_dtype(values, bf16));
  }
  std::vector<std::span<const std::byte>> data(bytes.begin(), bytes.end());
  write_safetensors((fs::path(dir) / "model.safetensors").string(), "--save-hf", {{"format", "pt"}}, tensors, data);
  // the config read with --init-from (its shape fields are the model's: check_config) keeps its
  // other fields (token ids, the longest context...); only the weights' dtype may change
  json config = source_config.empty() ? config_of(s, bf16) : json::parse(source_config);
  config["architectures"] = {std::string(a.class_name)};
  for (const char *dtype : {"dtype", "torch_dtype"})
    if (dtype == std::string_view("dtype") || config.contains(dtype)) config[dtype] = bf16 ? "bfloat16" : "float32";
  const std::string text = config.dump(2) + "\n";
  write_atomically((fs::path(dir) / "config.json").string(), "--save-hf", [&](std::ostream &out) { out << text; });
}

void save_gradients(Executor &ex, const Plan &plan, const ModelInfo &info, const std::string &dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create the folder ({})", dir, ec.message()));
  ex.download(plan.grads());
  const std::span<float> grads = ex.tensor<float>(plan.grads());
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<float>> values;
  if (!info.defaults.transformers.empty()) {  // Transformers' names and layouts
    for (const TransformersTensor &t :
         transformers_layout(info.model, plan, info.defaults.transformers, info.name).tensors) {
      values.emplace_back(std::size_t(t.rows * t.count));
      t.write(parameter_in(grads, plan, t.param), values.back());
      tensors.push_back({.name = t.name, .dtype = "F32", .shape = t.shape()});
    }
  } else {  // remat's PyTorch-style names (named_parameters)
    for (const NamedParameter &p : named_parameters(plan)) {
      values.push_back(to_file_layout(p, parameter_in(grads, plan, p.id)));
      tensors.push_back({.name = p.name, .dtype = "F32", .shape = p.shape});
    }
  }
  std::vector<std::span<const std::byte>> data;
  for (const auto &v : values) data.push_back(std::as_bytes(std::span(v)));
  write_safetensors((fs::path(dir) / "gradients.safetensors").string(), "--save-gradients",
                    {{"format", "pt"}, {"model", std::string(info.name)}}, tensors, data);
}

}  // namespace remat::runtime
