// The executor, built: every step of a plan bound once to its kernel (the CPU variant this
// machine runs), its scalars and its arena buffers; the tensors' host views. Running the steps:
// executor_run.cpp; offload copies: offload.cpp; REMAT_PROFILE's report: profile.cpp.
module;
#include <HalideRuntime.h>
#include <HalideRuntimeCuda.h>

#include "cpu_variant.h"
#include "cuda_device.h"
#include "gemm.h"

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

// In the kernels' archives only when they were generated with CUDA (a cuda arena exists only then:
// cuda::init() checks).
#pragma weak halide_cuda_wrap_device_ptr
module remat.runtime;
import remat;

namespace remat::runtime {

// ---- CPU kernel variants ---------------------------------------------------------------------
// The CPU kernels come in an AVX-512 and an AVX2 variant (generators/modelc.cpp); Halide's
// wrapper asks halide_can_use_target_features, once per kernel, which one the CPU can run. This
// answer refuses AVX-512 when REMAT_CPU_VARIANT=avx2 (installed before any kernel runs).
namespace {
bool has_feature(const std::uint64_t *features, int f) { return (features[f >> 6] >> (f & 63)) & 1; }

int can_use_target_features(int count, const std::uint64_t *features) {
  if (cpu_avx2_forced() && has_feature(features, halide_target_feature_avx512)) return 0;
  return halide_default_can_use_target_features(count, features);
}

[[maybe_unused]] const auto previous_can_use = halide_set_custom_can_use_target_features(can_use_target_features);
}  // namespace

std::string_view cpu_kernel_variant() {
  constexpr int words = (halide_target_feature_end + 63) / 64;
  std::uint64_t avx512[words] = {};
  for (int f : {halide_target_feature_avx512, halide_target_feature_avx512_skylake})
    avx512[f >> 6] |= std::uint64_t(1) << (f & 63);
  return can_use_target_features(words, avx512) ? "avx512" : "avx2";
}

// ---- Binding -----------------------------------------------------------------------------------
namespace {
const Kernel &find_kernel(std::span<const Kernel> kernels, std::string_view model, const KernelKey &key) {
  for (const Kernel &k : kernels)
    if (k.key == key) return k;
  throw std::runtime_error(fmt::format("kernel {} is not in the generated kernel table", name_of(model, key).view()));
}

void *scalar_field(Scalars &s, Scalar which) {
  switch (which) {
  case Scalar::accumulate: return &s.accumulate;
  case Scalar::grad_scale: return &s.grad_scale;
  case Scalar::lr: return &s.lr;
  case Scalar::beta1: return &s.beta1;
  case Scalar::beta2: return &s.beta2;
  case Scalar::eps: return &s.eps;
  case Scalar::weight_decay: return &s.weight_decay;
  case Scalar::bias1: return &s.bias1;
  case Scalar::bias2: return &s.bias2;
  case Scalar::seed: return &s.seed;
  case Scalar::step: return &s.step;
  case Scalar::drop_threshold: return &s.drop_threshold;
  case Scalar::drop_scale: return &s.drop_scale;
  case Scalar::first_row: return &s.first_row;
  case Scalar::rng_block: break;  // per call: the executor's
  }
  return nullptr;
}
}  // namespace

namespace {
// The plan must fit the arena: every root inside it, every view inside its root.
void check_fits(const Plan &plan, const Arena &arena) {
  if (arena.size() < std::max(plan.peak_bytes, plan.eval_peak_bytes))
    throw std::runtime_error(fmt::format("the plan needs an arena of {} bytes; this one has {}",
                                         std::max(plan.peak_bytes, plan.eval_peak_bytes), arena.size()));
  for (const Tensor &t : plan.tensors) {
    const std::size_t room = t.view_of < 0 ? arena.size() : plan.tensors[t.view_of].bytes();
    if (t.offset > room || t.bytes() > room - t.offset)
      throw std::runtime_error(
          fmt::format("tensor {} ({} bytes at {}) does not fit in {} ({} bytes)", name_of(t.key).view(), t.bytes(),
                      t.offset, t.view_of < 0 ? "the arena" : name_of(plan.tensors[t.view_of].key).view(), room));
  }
}
}  // namespace

Executor::Executor(const Plan &plan, std::string_view model_name, std::span<const Kernel> kernels, Arena &arena,
                   Scalars &scalars, Checks checks_)
    : plan(plan), arena(arena), checks(checks_) {
  if (checks.free_memory && arena.device() == Device::cuda)
    throw std::runtime_error("the free-memory check reads the arena on the host: not on --device cuda");
  if (plan.rows < min_kernel_rows)
    throw std::runtime_error(
        fmt::format("the plan has {} rows per micro-batch; the kernels need at least {}", plan.rows, min_kernel_rows));
  check_fits(plan, arena);
  if (kernels.empty())
    throw std::runtime_error(fmt::format("model {} has no kernels for this device in this build", model_name));
  // Halide starts its worker threads on the first parallel loop (allocating their stacks and
  // thread state): start them here, so that no training step allocates.
  halide_do_par_for(nullptr, [](void *, int, std::uint8_t *) { return 0; }, 0, 256, nullptr);
  if (arena.device() != Device::cuda) gemm_warm_up();  // and MKL its per-thread buffers (CUDA: cuBLASLt)
  auto bind_all = [&](const std::vector<Step> &steps, std::vector<std::unique_ptr<Bound>> &calls) {
    for (const Step &st : steps)
      calls.push_back(
          bind(st, find_kernel(kernels, model_name, kernel_key(st.stage, st.variant, plan.precision)), scalars));
  };
  bind_all(plan.train, train_calls);
  bind_all(plan.optimize, optimize_calls);
  bind_all(plan.eval, eval_calls);
  break_on_purpose();
  if (plan.offload_bytes) transfers = std::make_unique<Transfers>(plan, arena);
}

// The kernel's arguments are the step's, position by position (its signature's order: scalars,
// then buffers read, then buffers written); the metadata only confirms it.
std::unique_ptr<Executor::Bound> Executor::bind(const Step &st, const Kernel &kernel, Scalars &scalars) const {
  auto b = std::make_unique<Bound>();
  b->rng_block = st.rng_block;
  b->flops = st.flops;
  b->kernel = &kernel;
  const halide_filter_metadata_t *md = kernel.metadata();
  const int n_scalars = int(st.scalars.size());
  if (md->num_arguments != n_scalars + int(st.args.size()))
    throw std::runtime_error(fmt::format("{}: the kernel has {} arguments, the plan's step {} (a stale build?)",
                                         kernel.name, md->num_arguments, n_scalars + st.args.size()));
  b->buffers.resize(md->num_arguments);
  b->shapes.resize(md->num_arguments);
  b->argv.resize(md->num_arguments);
  for (int a = 0; a < md->num_arguments; ++a) {
    const halide_filter_argument_t &arg = md->arguments[a];
    if (a >= n_scalars) {
      bind_buffer(*b, a, arg, st.args[a - n_scalars]);
      continue;
    }
    const Scalar which = st.scalars[a];
    const ScalarInfo &expected = info(which);
    if (arg.kind != halide_argument_kind_input_scalar || arg.type.bytes() != element_bytes(expected.element))
      throw std::runtime_error(fmt::format("{}: argument {} ({}) is not the scalar {} of the signature", kernel.name, a,
                                           arg.name, expected.name));
    b->argv[a] = which == Scalar::rng_block                          ? &b->rng_block
                 : which == Scalar::weight_decay && !st.weight_decay ? &b->no_weight_decay
                 : which == Scalar::accumulate && st.accumulates     ? &b->accumulates
                                                                     : scalar_field(scalars, which);
  }
  return b;
}

// Buffer argument `a` of the call: the tensor the step binds there, in the arena (its device
// memory on CUDA; kernels never touch the host mirror).
void Executor::bind_buffer(Bound &b, int a, const halide_filter_argument_t &arg, const Arg &step_arg) const {
  const bool written = arg.kind == halide_argument_kind_output_buffer;
  if (arg.kind == halide_argument_kind_input_scalar || written != (step_arg.access == Access::write))
    throw std::runtime_error(fmt::format("{}: argument {} ({}) is not the {} buffer {} of the plan", b.kernel->name, a,
                                         arg.name, step_arg.access == Access::write ? "written" : "read",
                                         name_of(plan.tensors[step_arg.tensor].key).view()));
  const Tensor &t = plan.tensors[step_arg.tensor];
  b.bytes += t.bytes();
  if (t.dims != arg.dimensions || t.elem_bytes != arg.type.bytes())
    throw std::runtime_error(fmt::format("{}: argument {} has {} dimensions of {}-byte elements, tensor {} {} of {}",
                                         b.kernel->name, arg.name, arg.dimensions, arg.type.bytes(),
                                         name_of(t.key).view(), t.dims, t.elem_bytes));
  if (t.bytes() > std::size_t(INT32_MAX))
    throw std::runtime_error(
        fmt::format("tensor {} has {} bytes; Halide buffers hold at most 2 GiB", name_of(t.key).view(), t.bytes()));
  const std::size_t offset = plan.arena_offset(step_arg.tensor);
  halide_buffer_t &buf = b.buffers[a];
  buf = {};
  buf.type = arg.type;
  buf.dimensions = t.dims;
  buf.dim = b.shapes[a].data();
  std::int32_t stride = 1;
  for (int d = 0; d < t.dims; ++d) {
    b.shapes[a][d] = {0, std::int32_t(t.extent[d]), stride, 0};
    stride *= std::int32_t(t.extent[d]);
  }
  if (arena.device() == Device::cuda) {
    const auto device_ptr = reinterpret_cast<std::uint64_t>(arena.device_data() + offset);
    if (int err = halide_cuda_wrap_device_ptr(nullptr, &buf, device_ptr); err != 0)
      throw std::runtime_error(
          fmt::format("{}: cannot wrap device memory for {} (Halide error {})", b.kernel->name, arg.name, err));
  } else {
    buf.host = reinterpret_cast<std::uint8_t *>(arena.data() + offset);
  }
  (written ? b.outputs : b.inputs).push_back(a);
  b.argv[a] = &buf;
}

Executor::~Executor() { report_profile(); }

std::vector<double> Executor::call_seconds(Phase phase) const {
  std::vector<double> out;
  for (const auto &b : phase == Phase::train ? train_calls : phase == Phase::optimize ? optimize_calls : eval_calls)
    out.push_back(b->seconds);
  return out;
}
long Executor::timed_runs(Phase phase) const {
  const auto &calls = phase == Phase::train ? train_calls : phase == Phase::optimize ? optimize_calls : eval_calls;
  return calls.empty() ? 0 : calls.front()->calls;
}

std::pair<std::size_t, std::size_t> Executor::locate(TensorId id, std::size_t elem_bytes) const {
  if (id.index < 0 || id.index >= int(plan.tensors.size()))
    throw std::runtime_error(fmt::format("tensor handle {} is not one of this plan's", id.index));
  const Tensor &t = plan.tensors[id.index];
  if (elem_bytes && std::size_t(t.elem_bytes) != elem_bytes)
    throw std::runtime_error(
        fmt::format("tensor {} has {}-byte elements, not {}", name_of(t.key).view(), t.elem_bytes, elem_bytes));
  return {plan.arena_offset(id.index), t.bytes()};
}

std::vector<float> Executor::values(TensorId t) const {
  auto [offset, bytes] = locate(t);
  const std::byte *at = arena.data() + offset;
  const std::size_t size = element_size(t);
  std::vector<float> out(bytes / size);
  if (size == 4) {
    std::memcpy(out.data(), at, bytes);
  } else {
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::uint16_t h;
      std::memcpy(&h, at + 2 * i, 2);
      out[i] = bf16_to_float(h);
    }
  }
  return out;
}

void Executor::set_values(TensorId t, std::span<const float> from) {
  auto [offset, bytes] = locate(t);
  std::byte *at = arena.data() + offset;
  const std::size_t size = element_size(t);
  if (from.size() * size != bytes)
    throw std::runtime_error(fmt::format("tensor {} holds {} bytes, not {} values",
                                         name_of(plan.tensors[t.index].key).view(), bytes, from.size()));
  if (size == 4) {
    std::memcpy(at, from.data(), bytes);
  } else {
    for (std::size_t i = 0; i < from.size(); ++i) {
      const std::uint16_t h = float_to_bf16(from[i]);
      std::memcpy(at + 2 * i, &h, 2);
    }
  }
}

std::size_t Executor::element_size(TensorId t) const {
  locate(t);
  return std::size_t(plan.tensors[t.index].elem_bytes);
}

void Executor::upload(TensorId t) {
  auto [offset, bytes] = locate(t);
  arena.upload(offset, bytes);
}

void Executor::download(TensorId t) {
  auto [offset, bytes] = locate(t);
  arena.download(offset, bytes);
}

void Scalars::set_dropout(double p) {
  drop_threshold = std::uint64_t(std::llround(p * 4294967296.0));  // as generators/attention.h
  drop_scale = float(1.0 / (1.0 - p));
}

// ---- small helpers -----------------------------------------------------------------------------
std::string digest(std::span<const std::byte> bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::byte b : bytes) {
    h ^= std::uint64_t(b);
    h *= 1099511628211ull;
  }
  return fmt::format("{:016x}", h);
}

}  // namespace remat::runtime
