module;
#include <HalideRuntime.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <climits>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>
module remat.runtime;
import remat;

extern "C" std::atomic<size_t> remat_halide_heap_current, remat_halide_heap_peak;
extern "C" char remat_halide_error[1024];

namespace remat::runtime {

HalideHeap halide_heap() { return {remat_halide_heap_current.load(), remat_halide_heap_peak.load()}; }
void reset_halide_heap_peak() { remat_halide_heap_peak = remat_halide_heap_current.load(); }

// ---- Arena -------------------------------------------------------------------------------------
namespace {
constexpr std::uint32_t canary = 0x7FA5A5A5u;  // a NaN payload no kernel produces
}

void Arena::Free::operator()(std::byte *p) const { std::free(p); }

Arena::Arena(std::size_t size)
    : base(static_cast<std::byte *>(std::aligned_alloc(arena_alignment, detail::align_up(size + 4)))),
      bytes(size) {
  if (!base) throw std::runtime_error(fmt::format("cannot allocate an arena of {} bytes", size));
}

void Arena::fill_canary() {
  auto *words = reinterpret_cast<std::uint32_t *>(base.get());
  std::fill(words, words + (bytes + 3) / 4, canary);
}

std::size_t Arena::high_water() const {
  const auto *words = reinterpret_cast<const std::uint32_t *>(base.get());
  for (std::size_t i = (bytes + 3) / 4; i > 0; --i)
    if (words[i - 1] != canary) return i * 4;
  return 0;
}

// ---- Executor ----------------------------------------------------------------------------------
struct Executor::Bound {
  const Kernel *kernel;
  float no_weight_decay = 0;  // AdamW over parameters that are not decayed
  double seconds = 0;  // with REMAT_PROFILE set: time spent in this call
  long calls = 0;
  std::int32_t rng_block = 0;
  std::vector<halide_buffer_t> buffers;
  std::vector<std::array<halide_dimension_t, 2>> shapes;
  std::vector<void *> argv;
};

namespace {
const Kernel &find_kernel(std::span<const Kernel> kernels, const Name &name) {
  for (const Kernel &k : kernels)
    if (name.view() == k.name) return k;
  throw std::runtime_error(fmt::format("kernel {} is not in the generated kernel table", name.view()));
}

void *scalar_field(Scalars &s, std::string_view name) {
  const std::pair<std::string_view, void *> fields[] = {
      {"accumulate", &s.accumulate}, {"grad_scale", &s.grad_scale}, {"lr", &s.lr},
      {"beta1", &s.beta1},           {"beta2", &s.beta2},           {"eps", &s.eps},
      {"weight_decay", &s.weight_decay}, {"bias1", &s.bias1},       {"bias2", &s.bias2},
      {"seed", &s.seed},             {"step", &s.step},             {"drop_threshold", &s.drop_threshold},
      {"drop_scale", &s.drop_scale}};
  for (auto [n, p] : fields)
    if (n == name) return p;
  throw std::runtime_error(fmt::format("no value for the scalar kernel argument {}", name));
}
}  // namespace

Executor::Executor(const Plan &plan, std::string_view model_name, std::span<const Kernel> kernels,
                   Arena &arena, Scalars &scalars)
    : plan(plan), arena(arena) {
  auto bind = [&](const Step &st) {
    auto b = std::make_unique<Bound>();
    b->rng_block = st.rng_block;
    b->kernel = &find_kernel(kernels, kernel_name(model_name, st.stage, st.variant));
    const halide_filter_metadata_t *md = b->kernel->metadata();
    b->buffers.resize(md->num_arguments);
    b->shapes.resize(md->num_arguments);
    b->argv.resize(md->num_arguments);
    for (int a = 0; a < md->num_arguments; ++a) {
      const halide_filter_argument_t &arg = md->arguments[a];
      if (arg.kind == halide_argument_kind_input_scalar) {
        const std::string_view scalar = arg.name;
        b->argv[a] = scalar == "rng_block"                             ? &b->rng_block
                     : scalar == "weight_decay" && !st.weight_decay ? &b->no_weight_decay
                                                                    : scalar_field(scalars, arg.name);
        continue;
      }
      // Halide makes Func names unique per process ("y$2", "adamw$1.0"); the plan's name is the
      // name without the "$<digits>".
      std::string arg_name = arg.name;
      if (const auto dollar = arg_name.find('$'); dollar != std::string::npos) {
        auto end = dollar + 1;
        while (end < arg_name.size() && std::isdigit((unsigned char)arg_name[end])) ++end;
        arg_name.erase(dollar, end - dollar);
      }
      auto it = std::find_if(st.args.begin(), st.args.end(),
                             [&](const Arg &x) { return x.name.view() == arg_name; });
      if (it == st.args.end())
        throw std::runtime_error(fmt::format("{}: the plan binds no tensor to argument {}",
                                             b->kernel->name, arg.name));
      const Tensor &t = plan.tensors[it->tensor];
      if (t.dims != arg.dimensions)
        throw std::runtime_error(fmt::format("{}: argument {} has {} dimensions, tensor {} has {}",
                                             b->kernel->name, arg.name, arg.dimensions,
                                             t.name.view(), t.dims));
      std::size_t offset = t.offset;
      if (t.view_of >= 0) offset += plan.tensors[t.view_of].offset;
      halide_buffer_t &buf = b->buffers[a];
      buf = {};
      buf.host = reinterpret_cast<std::uint8_t *>(arena.data() + offset);
      buf.type = arg.type;
      buf.dimensions = t.dims;
      buf.dim = b->shapes[a].data();
      std::int32_t stride = 1;
      if (t.bytes() > std::size_t(INT32_MAX))
        throw std::runtime_error(fmt::format("tensor {} has {} bytes; Halide buffers hold at most 2 GiB",
                                             t.name.view(), t.bytes()));
      for (int d = 0; d < t.dims; ++d) {
        b->shapes[a][d] = {0, std::int32_t(t.extent[d]), stride, 0};
        stride *= std::int32_t(t.extent[d]);
      }
      b->argv[a] = &buf;
    }
    return b;
  };
  for (const Step &st : plan.train) train_calls.push_back(bind(st));
  for (const Step &st : plan.optimize) optimize_calls.push_back(bind(st));
  for (const Step &st : plan.eval) eval_calls.push_back(bind(st));
}


void Executor::run(Phase phase) {
  static const bool trace = std::getenv("REMAT_TRACE_HEAP") != nullptr;
  static const bool profile = std::getenv("REMAT_PROFILE") != nullptr;
  auto &calls = phase == Phase::train ? train_calls : phase == Phase::optimize ? optimize_calls : eval_calls;
  for (auto &b : calls) {
    if (trace) std::fprintf(stderr, "kernel %s\n", b->kernel->name);
    const auto t0 = profile ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    if (int err = b->kernel->argv(b->argv.data()); err != 0) {
      const std::string message = remat_halide_error;
      remat_halide_error[0] = 0;
      throw std::runtime_error(fmt::format("kernel {} failed (Halide error {}): {}", b->kernel->name, err, message));
    }
    if (profile) {
      b->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++b->calls;
    }
  }
}

// With REMAT_PROFILE set, the time per kernel, summed over its calls, on stderr.
Executor::~Executor() {
  if (!std::getenv("REMAT_PROFILE")) return;
  std::map<std::string, std::pair<double, long>> by_kernel;
  for (auto *list : {&train_calls, &optimize_calls, &eval_calls})
    for (auto &b : *list) {
      by_kernel[b->kernel->name].first += b->seconds;
      by_kernel[b->kernel->name].second += b->calls;
    }
  for (const auto &[name, t] : by_kernel)
    if (t.second) std::fprintf(stderr, "profile %-32s %8.3f s %6ld calls\n", name.c_str(), t.first, t.second);
}

std::pair<std::byte *, std::size_t> Executor::locate(std::string_view name) const {
  const int i = plan.find(name);
  if (i < 0) throw std::runtime_error(fmt::format("the plan has no tensor {}", name));
  const Tensor &t = plan.tensors[i];
  std::size_t offset = t.offset + (t.view_of >= 0 ? plan.tensors[t.view_of].offset : 0);
  return {arena.data() + offset, t.bytes()};
}

void Scalars::set_dropout(double p) {
  drop_threshold = std::uint64_t(std::llround(p * 4294967296.0));  // as generators/attention.h
  drop_scale = float(1.0 / (1.0 - p));
}

// ---- small helpers -----------------------------------------------------------------------------
Policy parse_policy(std::string_view text) {
  if (text == "none") return none;
  if (text == "full") return full;
  if (text == "sqrt_n") return sqrt_n;
  if (text == "selective") return selective;
  constexpr std::string_view every = "every_n_layers=";
  if (text.starts_with(every)) {
    const auto digits = text.substr(every.size());
    int n = 0;
    bool ok = !digits.empty() && digits.size() < 9;
    for (char c : digits) {
      ok = ok && c >= '0' && c <= '9';
      n = n * 10 + (c - '0');
    }
    if (!ok || n < 1)
      throw InputError(fmt::format("--checkpoint-policy {}: every_n_layers needs a whole number N >= 1", text));
    return {Policy::Kind::every_n_layers, n};
  }
  throw InputError(fmt::format(
      "--checkpoint-policy {}: unknown policy (use none, full, every_n_layers=N, sqrt_n or selective)", text));
}

std::string digest(std::span<const std::byte> bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte b : bytes) {
    h ^= std::uint64_t(b);
    h *= 1099511628211ull;
  }
  return fmt::format("{:016x}", h);
}

}  // namespace remat::runtime
