// Snapshots and weights files.
//
// A snapshot is a folder as Hugging Face's Trainer writes its checkpoints: DIR/snapshot-<step>/
// holds model.safetensors (the parameters, PyTorch's names and layouts: named_parameters),
// optimizer.safetensors (the AdamW moments, <parameter>.exp_avg and .exp_avg_sq, in the same
// layouts) and trainer_state.json (the step, the run, the data position, each file's size and
// CRC-32, and a CRC-32 of itself); each tensor's CRC-32 is also in its file's metadata. The folder
// is built as snapshot-<step>.tmp, every file fsync'ed, and renamed when complete: a
// snapshot-<step> folder is always whole, and an older one is removed only after a newer is.
module;
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>
module remat.trainer;
import remat;

#ifndef REMAT_VERSION
#define REMAT_VERSION "unknown"
#endif

namespace remat::runtime {
namespace fs = std::filesystem;

std::string_view remat_version() { return REMAT_VERSION; }

// ---------------------------------------------------------------------------------------------
// Parameters by PyTorch's names and layouts
std::vector<NamedParameter> named_parameters(const Plan &plan) {
  std::vector<NamedParameter> out;
  for (int i = 0; i < int(plan.tensors.size()); ++i) {
    const Tensor &t = plan.tensors[i];
    if (t.role != Role::params || t.key.layer < 0) continue;  // a layer's parameter (not a flat range)
    const Kind &k = kind(t.key.op);
    std::string_view param = t.key.index == 0 ? "weight" : "bias";
    if (k.name == "embedding") param = t.key.index == 0 ? "token.weight" : "position.weight";
    NamedParameter p{fmt::format("stages.{}.blocks.{}.layers.{}.{}", t.key.stage, t.key.block, t.key.layer, param),
                     TensorId{i},
                     {t.extent[0]},
                     k.gemm && t.dims == 2};
    if (t.dims == 2)
      p.shape = p.transposed ? std::vector{t.extent[0], t.extent[1]} : std::vector{t.extent[1], t.extent[0]};
    out.push_back(std::move(p));
  }
  return out;
}

namespace {
// Transposes a [rows, cols] row-major matrix (a linear's [in, out] weight to PyTorch's [out, in]).
std::vector<float> transposed(std::span<const float> v, long long rows, long long cols) {
  std::vector<float> out(v.size());
  for (long long r = 0; r < rows; ++r)
    for (long long c = 0; c < cols; ++c) out[std::size_t(c * rows + r)] = v[std::size_t(r * cols + c)];
  return out;
}
}  // namespace

std::vector<float> to_file_layout(const NamedParameter &p, std::span<const float> values) {
  if (!p.transposed) return {values.begin(), values.end()};
  return transposed(values, p.shape[1], p.shape[0]);  // remat's [in, out] -> [out, in]
}
void from_file_layout(const NamedParameter &p, std::span<const float> file, std::span<float> values) {
  if (!p.transposed) {
    std::ranges::copy(file, values.begin());
    return;
  }
  const std::vector<float> t = transposed(file, p.shape[0], p.shape[1]);  // [out, in] -> [in, out]
  std::ranges::copy(t, values.begin());
}

std::string definition_digest(const Model &m) {
  std::string text =
      fmt::format("input {} {} {}; loss {};", m.input.width, m.input.vocab, m.input.block_size, m.loss.classes);
  for (int s = 0; s < m.n_stages; ++s) {
    const Block &b = m.stages[s];
    text += fmt::format(" stage {} x{}:", s, b.repeat);
    for (int l = 0; l < b.n_layers; ++l) {
      const Layer &y = b.layers[l];
      text += fmt::format(" {}({},{},{},{},{},{},{})", kind(y.op).name, y.in, y.out, y.heads, y.kv_heads, y.vocab,
                          y.block_size, y.bias);
      // constants a model may set away from the kinds' defaults, and ties (written only when set,
      // so that the digests of models without them stay as they were)
      const double default_eps = y.op == Op::layer_norm ? layer_norm_default_eps : rms_norm_default_eps;
      if (y.eps != 0 && y.eps != default_eps) text += fmt::format("[eps {}]", y.eps);
      if (y.op == Op::rope && y.rope_theta != rope_default_theta) text += fmt::format("[theta {}]", y.rope_theta);
      if (const Layer::RopeScaling &r = y.rope_scaling; r.enabled())
        text +=
            fmt::format("[llama3 {} {} {} {}]", r.factor, r.low_freq_factor, r.high_freq_factor, r.original_context);
      if (y.gelu_exact) text += "[exact]";
      if (y.tied()) text += fmt::format("[tied {}.{}]", y.tie_stage, y.tie_layer);
    }
  }
  return digest(std::as_bytes(std::span(text)));
}

// ---------------------------------------------------------------------------------------------
// Engine: snapshots and weights
namespace {
constexpr std::string_view snapshot_format = "remat-snapshot-folder 1";
constexpr const char *model_file = "model.safetensors", *optimizer_file = "optimizer.safetensors",
                     *state_file = "trainer_state.json";

std::string shape_text(const std::vector<long long> &shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::span<float> in_buffer(Executor &ex, const Plan &plan, TensorId buffer, const NamedParameter &p) {
  return parameter_in(ex.tensor<float>(buffer), plan, p.id);
}
bool sharded(const Plan &plan) {
  return plan.shard_end - plan.shard_first < plan.tensors[plan.params().index].extent[0];
}

// The first parameter holding a NaN or an infinity, or "".
std::string first_nonfinite(Executor &ex, const Plan &plan, std::span<const NamedParameter> params) {
  for (const NamedParameter &p : params)
    if (!std::ranges::all_of(in_buffer(ex, plan, plan.params(), p), [](float v) { return std::isfinite(v); }))
      return p.name;
  return {};
}

// The tensors of `file` against what the model expects (names, shapes, dtypes, CRC-32 when given),
// every mismatch listed.
std::vector<std::string> mismatches(const Safetensors &file,
                                    const std::map<std::string, std::vector<long long>> &expected, bool need_crc,
                                    bool any_float) {
  std::vector<std::string> out;
  for (const auto &[name, shape] : expected) {
    const SafetensorsTensor *t = file.find(name);
    if (!t) {
      out.push_back(fmt::format("{} {} missing", name, shape_text(shape)));
      continue;
    }
    if (t->shape != shape)
      out.push_back(
          fmt::format("{} is {} in the file, {} in the model", name, shape_text(t->shape), shape_text(shape)));
    else if (t->dtype != "F32" && !(any_float && (t->dtype == "BF16" || t->dtype == "F16")))
      out.push_back(fmt::format("{} is {}, not {}", name, t->dtype, any_float ? "F32, BF16 or F16" : "F32"));
    const auto crc = file.metadata.find("crc32." + name);
    if (crc == file.metadata.end() ? need_crc : crc->second != crc32_hex(file.data(*t)))
      out.push_back(
          fmt::format("{}: {}", name, crc == file.metadata.end() ? "no CRC-32" : "CRC-32 mismatch (damaged data)"));
  }
  for (const SafetensorsTensor &t : file.tensors)
    if (!expected.contains(t.name)) out.push_back(fmt::format("{} is not a parameter of the model", t.name));
  return out;
}

}  // namespace

std::vector<float> floats(const Safetensors &file, const SafetensorsTensor &t) {
  const std::span<const std::byte> d = file.data(t);
  const std::size_t n = t.dtype == "F32" ? d.size() / 4 : d.size() / 2;
  std::vector<float> out(n);
  if (t.dtype == "F32") {
    std::memcpy(out.data(), d.data(), d.size());
    return out;
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, d.data() + 2 * i, 2);
    if (t.dtype == "BF16") {
      out[i] = bf16_to_float(h);
    } else {
      _Float16 f;
      std::memcpy(&f, &h, 2);
      out[i] = float(f);
    }
  }
  return out;
}

namespace {
// `parts`, buffers of the flat parameters' layout, each parameter as <name><suffix>, to a
// safetensors file.
struct Part {
  std::span<const float> flat;
  std::string_view suffix;
};
void write_buffers(Executor &ex, std::string_view model, const std::string &path, std::initializer_list<Part> parts) {
  const std::vector<NamedParameter> params = named_parameters(ex.plan);
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<float>> values;
  for (const Part &part : parts)
    for (const NamedParameter &p : params) {
      tensors.push_back({.name = p.name + std::string(part.suffix), .dtype = "F32", .shape = p.shape});
      values.push_back(to_file_layout(p, parameter_in(part.flat, ex.plan, p.id)));
    }
  std::vector<std::span<const std::byte>> data;
  for (const auto &v : values) data.push_back(std::as_bytes(std::span(v)));
  write_safetensors(path, "snapshot", {{"format", "pt"}, {"model", std::string(model)}}, tensors, data);
}

nlohmann::json with_crc(nlohmann::json j) {
  j.erase("crc32");
  const std::string text = j.dump();
  j["crc32"] = crc32_hex(std::as_bytes(std::span(text)));
  return j;
}
}  // namespace

namespace {
// The files of a snapshot into `folder`.
void write_snapshot_files(Executor &ex, std::string_view model_name, const fs::path &folder, const SnapshotState &state,
                          const Moments &moments) {
  const Plan &plan = ex.plan;
  for (TensorId t : {plan.params(), plan.adam_m(), plan.adam_v()}) ex.download(t);
  if (sharded(plan) && moments.m.empty())
    throw std::logic_error("a snapshot of a sharded optimizer needs every rank's moments");
  const std::span<const float> m = moments.m.empty() ? ex.tensor<float>(plan.adam_m()) : moments.m,
                               v = moments.v.empty() ? ex.tensor<float>(plan.adam_v()) : moments.v;
  write_buffers(ex, model_name, (folder / model_file).string(), {{ex.tensor<float>(plan.params()), ""}});
  write_buffers(ex, model_name, (folder / optimizer_file).string(), {{m, ".exp_avg"}, {v, ".exp_avg_sq"}});
  nlohmann::json files = nlohmann::json::object();
  for (const char *f : {model_file, optimizer_file}) {  // read back: what is on disk is what is summed
    const std::vector<std::byte> bytes = read_bytes((folder / f).string());
    files[f] = {{"bytes", bytes.size()}, {"crc32", crc32_hex(bytes)}};
  }
  const nlohmann::json j = with_crc({{"format", snapshot_format},
                                     {"global_step", state.step},
                                     {"max_steps", state.max_steps},
                                     {"remat_version", remat_version()},
                                     {"model", model_name},
                                     {"model_definition", state.model_definition},
                                     {"param_count", plan.param_count},
                                     {"seed", state.seed},
                                     {"run", state.run},
                                     {"data", state.data},
                                     {"files", files}});
  write_atomically((folder / state_file).string(), "snapshot", [&](std::ostream &out) { out << j.dump(1) << '\n'; });
  sync_path(folder.string(), "snapshot");
}
}  // namespace

void save_snapshot(Engine &engine, const std::string &folder, const SnapshotState &state, const Moments &moments) {
  const fs::path done(folder), tmp = folder + ".tmp", old = folder + ".old";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) || ec)
    throw InputError(fmt::format("snapshot {}: cannot create the folder ({})", tmp.string(), ec.message()));
  try {
    write_snapshot_files(engine.executor, engine.model_name, tmp, state, moments);
    if (fs::exists(done)) fs::rename(done, old);  // a snapshot of the same step (a repeated run) is replaced
    fs::rename(tmp, done);
    fs::remove_all(old);
  } catch (const fs::filesystem_error &e) {
    fs::remove_all(tmp, ec);
    throw InputError(fmt::format("snapshot {}: {}", folder, e.code().message()));
  } catch (...) {
    fs::remove_all(tmp, ec);  // a full disk gets its space back; the older snapshots are untouched
    throw;
  }
  sync_path(done.has_parent_path() ? done.parent_path().string() : ".", "snapshot");
}

namespace {
// trainer_state.json of a snapshot folder, its own CRC-32 checked.
nlohmann::json read_state(const fs::path &folder, const std::string &what) {
  const fs::path path = folder / state_file;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) throw InputError(fmt::format("{}: no such folder", what));
  if (!fs::exists(path, ec)) throw InputError(fmt::format("{}: no {} (not a snapshot folder)", what, state_file));
  const std::vector<std::byte> bytes = read_bytes(path.string());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(std::string_view(reinterpret_cast<const char *>(bytes.data()), bytes.size()));
  } catch (const nlohmann::json::exception &) {
    throw InputError(fmt::format("{}: {} is not JSON (damaged)", what, state_file));
  }
  if (!j.is_object() || !j.contains("crc32") || !j["crc32"].is_string() || with_crc(j)["crc32"] != j["crc32"])
    throw InputError(fmt::format("{}: {} is damaged (its CRC-32 does not match)", what, state_file));
  if (j.value("format", "") != snapshot_format)
    throw InputError(fmt::format("{}: {} is not of a remat snapshot ({})", what, state_file, snapshot_format));
  return j;
}

// One of the snapshot's safetensors files: size and CRC-32 as trainer_state.json records them,
// then every tensor's name, shape and CRC-32.
Safetensors read_part(const fs::path &folder, const char *name, const nlohmann::json &files,
                      const std::map<std::string, std::vector<long long>> &expected, const std::string &what) {
  std::vector<std::byte> bytes = read_bytes((folder / name).string());
  const nlohmann::json &f = files.at(name);
  if (bytes.size() != f.at("bytes").get<std::size_t>())
    throw InputError(fmt::format("{}: {} has {} bytes, {} were written (truncated or damaged)", what, name,
                                 bytes.size(), f.at("bytes").get<std::size_t>()));
  if (crc32_hex(bytes) != f.at("crc32").get<std::string>())
    throw InputError(fmt::format("{}: {} is damaged (its CRC-32 does not match)", what, name));
  Safetensors st = parse_safetensors(std::move(bytes), fmt::format("{}: {}", what, name));
  if (const auto bad = mismatches(st, expected, true, false); !bad.empty())
    throw InputError(fmt::format("{}: {}: {}", what, name, fmt::join(bad, "; ")));
  return st;
}
}  // namespace

SnapshotState load_snapshot(Engine &engine, const std::string &folder) {
  const Plan &plan = engine.plan;
  const std::string &model_name = engine.model_name;
  Executor &executor = engine.executor;
  const std::string &what = folder;
  const nlohmann::json j = read_state(folder, what);
  SnapshotState state;
  Safetensors model, optimizer;
  try {
    const std::string owner = j.at("model").get<std::string>();
    if (owner != model_name || j.at("param_count").get<long long>() != plan.param_count)
      throw InputError(fmt::format("{}: a snapshot of model {} with {} parameters; this is {} with {}", what, owner,
                                   j.at("param_count").get<long long>(), model_name, plan.param_count));
    state = {.step = j.at("global_step").get<long>(),
             .max_steps = j.at("max_steps").get<long>(),
             .seed = j.at("seed").get<std::uint64_t>(),
             .run = j.at("run").get<std::string>(),
             .data = j.at("data").get<std::string>(),
             .model_definition = j.at("model_definition").get<std::string>(),
             .remat_version = j.at("remat_version").get<std::string>()};
    if (state.step < 1 || state.max_steps < state.step)
      throw InputError(fmt::format("{}: {} says step {} of {}", what, state_file, state.step, state.max_steps));
    std::map<std::string, std::vector<long long>> params, moments;
    for (const NamedParameter &p : named_parameters(plan)) {
      params[p.name] = moments[p.name + ".exp_avg"] = moments[p.name + ".exp_avg_sq"] = p.shape;
    }
    model = read_part(folder, model_file, j.at("files"), params, what);
    optimizer = read_part(folder, optimizer_file, j.at("files"), moments, what);
  } catch (const nlohmann::json::exception &e) {
    throw InputError(fmt::format("{}: {} lacks a field or has a wrong type ({})", what, state_file, e.what()));
  }
  for (TensorId t : {plan.params(), plan.adam_m(), plan.adam_v()}) std::ranges::fill(executor.tensor<float>(t), 0.f);
  // the moments whole (a sharded plan keeps its shard of them)
  const bool shard = sharded(plan);
  const std::size_t slots = std::size_t(plan.tensors[plan.params().index].extent[0]);
  std::vector<float> m(shard ? slots : 0), v(m.size());
  const std::span<float> all_m = shard ? std::span(m) : executor.tensor<float>(plan.adam_m()),
                         all_v = shard ? std::span(v) : executor.tensor<float>(plan.adam_v());
  for (const NamedParameter &p : named_parameters(plan)) {
    from_file_layout(p, floats(model, *model.find(p.name)), in_buffer(executor, plan, plan.params(), p));
    from_file_layout(p, floats(optimizer, *optimizer.find(p.name + ".exp_avg")), parameter_in(all_m, plan, p.id));
    from_file_layout(p, floats(optimizer, *optimizer.find(p.name + ".exp_avg_sq")), parameter_in(all_v, plan, p.id));
  }
  if (shard)
    for (auto [whole, buffer] : {std::pair{std::span(m), plan.adam_m()}, std::pair{std::span(v), plan.adam_v()}})
      std::ranges::copy(whole.subspan(std::size_t(plan.shard_first), std::size_t(plan.shard_end - plan.shard_first)),
                        executor.tensor<float>(buffer).begin());
  if (const std::string bad = first_nonfinite(executor, plan, named_parameters(plan)); !bad.empty())
    throw InputError(
        fmt::format("{}: parameter {} holds NaN or infinite values (the run that wrote it had diverged)", what, bad));
  for (TensorId t : {plan.params(), plan.adam_m(), plan.adam_v()}) executor.upload(t);
  return state;
}

void load_weights(Engine &engine, const std::string &path) {
  const Plan &plan = engine.plan;
  Executor &executor = engine.executor;
  std::string file = path;
  if (std::error_code ec; fs::is_directory(path, ec))
    file = (fs::path(path) / model_file).string();  // a snapshot folder
  const Safetensors st = read_safetensors(file);
  const std::vector<NamedParameter> params = named_parameters(plan);
  std::map<std::string, std::vector<long long>> expected;
  for (const NamedParameter &p : params) expected[p.name] = p.shape;
  if (const auto bad = mismatches(st, expected, false, true); !bad.empty())
    throw InputError(fmt::format("{}: {} mismatch{} with model {}: {}", file, bad.size(), bad.size() == 1 ? "" : "es",
                                 engine.model_name, fmt::join(bad, "; ")));
  executor.download(plan.params());
  for (const NamedParameter &p : params)
    from_file_layout(p, floats(st, *st.find(p.name)), in_buffer(executor, plan, plan.params(), p));
  if (const std::string bad = first_nonfinite(executor, plan, params); !bad.empty())
    throw InputError(fmt::format("{}: {} holds NaN or infinite values", file, bad));
  executor.upload(plan.params());
}

// ---------------------------------------------------------------------------------------------
// Snapshot folders
std::vector<std::pair<long, std::string>> snapshot_folders(const std::string &dir) {
  std::vector<std::pair<long, std::string>> out;
  std::error_code ec;
  for (const fs::directory_entry &e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    long step = 0;
    constexpr std::string_view prefix = "snapshot-";
    if (!name.starts_with(prefix) || !e.is_directory(ec)) continue;
    const char *first = name.data() + prefix.size(), *last = name.data() + name.size();
    if (auto [end, err] = std::from_chars(first, last, step); err == std::errc() && end == last && first != last)
      out.emplace_back(step, e.path().string());
  }
  std::ranges::sort(out);
  return out;
}

std::string resolve_snapshot(const std::string &path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    throw InputError(
        fmt::format("{}: {}", path, fs::exists(path, ec) ? "not a snapshot folder (a file)" : "no such folder"));
  if (fs::exists(fs::path(path) / state_file, ec)) return path;
  const auto folders = snapshot_folders(path);
  if (folders.empty())
    throw InputError(
        fmt::format("{}: no {} (not a snapshot folder) and no snapshot-<step> folders in it", path, state_file));
  return folders.back().second;
}

void remove_old_snapshots(const std::string &dir, int keep) {
  auto folders = snapshot_folders(dir);
  std::error_code ec;
  for (std::size_t i = 0; i + std::size_t(keep) < folders.size(); ++i) {
    const std::string old = folders[i].second + ".old";
    fs::rename(folders[i].second, old, ec);  // never leaves a partly removed snapshot-<step>
    if (!ec) fs::remove_all(old, ec);
  }
  for (const fs::directory_entry &e : fs::directory_iterator(dir, ec)) {  // what an interrupted save left
    const std::string name = e.path().filename().string();
    if (name.starts_with("snapshot-") && (name.ends_with(".tmp") || name.ends_with(".old")))
      fs::remove_all(e.path(), ec);
  }
}

std::size_t snapshot_bytes(const Plan &plan) { return 3 * std::size_t(plan.param_count) * sizeof(float) + (1u << 20); }

void check_output_dir(const std::string &dir, std::size_t bytes) {  // (OutputDirLock made the folder)
  check_writable((fs::path(dir) / ".remat-probe").string(), "--output-dir");
  struct statvfs s{};
  if (::statvfs(dir.c_str(), &s) == 0 && std::size_t(s.f_bavail) * s.f_frsize < bytes)
    throw InputError(fmt::format("--output-dir {}: {} B free, a snapshot needs {} B", dir,
                                 std::size_t(s.f_bavail) * s.f_frsize, bytes));
}

OutputDirLock::OutputDirLock(const std::string &dir) {
  const std::string path = (fs::path(dir) / ".remat-lock").string();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir, ec)) throw InputError(fmt::format("--output-dir {}: cannot create it", dir));
  fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw InputError(fmt::format("--output-dir {}: cannot open {}: {}", dir, path, std::strerror(errno)));
  char text[256] = {};
  const auto holder = [&] {
    const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
    std::string_view name(text, std::size_t(std::max<ssize_t>(n, 0)));
    while (name.ends_with('\n')) name.remove_suffix(1);
    return std::string(name);
  };
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    const std::string name = holder();
    ::close(std::exchange(fd, -1));
    if (error == EWOULDBLOCK)
      throw InputError(fmt::format("--output-dir {} is in use by another run ({}); give this run another folder", dir,
                                   name.empty() ? "it has not yet written its pid" : name));
    throw InputError(fmt::format("--output-dir {}: cannot lock {}: {}", dir, path, std::strerror(error)));
  }
  if (const std::string stale = holder(); !stale.empty())
    fmt::print(stderr, "--output-dir {}: taking over the lock of a run that ended without releasing it ({})\n", dir,
               stale);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string name = fmt::format("pid {} host {}\n", ::getpid(), host);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, name.data(), name.size(), 0) != ssize_t(name.size()))
    throw InputError(fmt::format("--output-dir {}: cannot write {}: {}", dir, path, std::strerror(errno)));
}

OutputDirLock::~OutputDirLock() {
  if (fd < 0) return;
  [[maybe_unused]] const int emptied = ::ftruncate(fd, 0);  // a normal end: no run to report
  ::close(fd);                                              // (and the flock with it)
}

}  // namespace remat::runtime
