module;
#include <HalideRuntime.h>
#include <HalideRuntimeCuda.h>

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
module remat.runtime;
import remat;

extern "C" std::atomic<size_t> remat_halide_heap_current, remat_halide_heap_peak;
extern "C" std::atomic<bool> remat_heap_counting;
extern "C" std::atomic<size_t> remat_heap_allocations, remat_heap_bytes;
extern "C" char remat_halide_error[1024];

namespace remat::runtime {

HalideHeap halide_heap() { return {remat_halide_heap_current.load(), remat_halide_heap_peak.load()}; }
void reset_halide_heap_peak() { remat_halide_heap_peak = remat_halide_heap_current.load(); }
StepHeap step_heap() { return {remat_heap_allocations.load(), remat_heap_bytes.load()}; }
void reset_step_heap() {
  remat_heap_allocations = 0;
  remat_heap_bytes = 0;
}

CountedHeap::CountedHeap() { remat_heap_counting = true; }
CountedHeap::~CountedHeap() { remat_heap_counting = false; }

namespace {
struct PausedCounting {
  PausedCounting() { remat_heap_counting = false; }
  ~PausedCounting() { remat_heap_counting = true; }
};
}  // namespace

// ---- CPU kernel variants ---------------------------------------------------------------------
// The CPU kernels come in an AVX-512 and an AVX2 variant (generators/modelc.cpp); Halide's
// wrapper asks halide_can_use_target_features, once per kernel, which one the CPU can run. This
// answer refuses AVX-512 when REMAT_CPU_VARIANT=avx2 (installed before any kernel runs).
namespace {
bool has_feature(const std::uint64_t *features, int f) { return (features[f >> 6] >> (f & 63)) & 1; }

bool avx2_forced() {
  static const bool forced = [] {
    const char *v = std::getenv("REMAT_CPU_VARIANT");
    if (!v || !*v || std::string_view(v) == "auto") return false;
    if (std::string_view(v) == "avx2") return true;
    std::fprintf(stderr, "REMAT_CPU_VARIANT=%s: expected avx2 or auto\n", v);
    std::exit(2);
  }();
  return forced;
}

int can_use_target_features(int count, const std::uint64_t *features) {
  if (avx2_forced() && has_feature(features, halide_target_feature_avx512)) return 0;
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

// ---- Arena -------------------------------------------------------------------------------------
namespace {
// A NaN payload no kernel produces, as fp32 (0x7FA57FA5) and as each of its bf16 halves; the
// arena is filled and scanned in 16-bit units (every tensor is a whole number of them).
constexpr std::uint16_t canary = 0x7FA5u;
constexpr std::size_t canary_units(std::size_t bytes) { return (bytes + 1) / 2; }
}  // namespace

Arena::Arena(std::size_t size, Device device) : bytes(size), where(device) {
  const std::size_t total = align_up(size + guard_bytes);
  host = static_cast<std::byte *>(std::aligned_alloc(arena_alignment, total));
  if (!host) throw std::runtime_error(fmt::format("cannot allocate an arena of {} bytes", size));
  if (device == Device::cuda) {
    try {
      cuda::init();
      dev = static_cast<std::byte *>(cuda::device_malloc(total));
    } catch (...) {
      std::free(host);
      throw;
    }
  }
  fill_canary(bytes, guard_bytes);  // the guard holds the canary from the start, filled or not
  upload(bytes, guard_bytes);
}

Arena::~Arena() {
  if (dev) cuda::device_free(dev);
  std::free(host);
}

void Arena::upload(std::size_t offset, std::size_t n) {
  if (dev) cuda::copy_to_device(dev + offset, host + offset, n, cuda::Stream::compute);
}

void Arena::download(std::size_t offset, std::size_t n) {
  if (!dev) return;
  cuda::copy_to_host(host + offset, dev + offset, n, cuda::Stream::compute);
  cuda::synchronize(cuda::Stream::compute);
}

void Arena::synchronize() {
  if (dev) cuda::synchronize(cuda::Stream::compute);
}

void Arena::fill_canary(std::size_t offset, std::size_t n) {
  auto *units = reinterpret_cast<std::uint16_t *>(host + offset);
  std::fill(units, units + canary_units(n), canary);
}

void Arena::fill_canary() {
  filled = true;
  released_high = 0;
  fill_canary(0, bytes + guard_bytes);
  upload(0, canary_units(bytes + guard_bytes) * 2);
}

long Arena::first_written(std::size_t offset, std::size_t n) const {
  const auto *units = reinterpret_cast<const std::uint16_t *>(host + offset);
  const auto *end = units + canary_units(n);
  const auto *hit = std::find_if(units, end, [](std::uint16_t u) { return u != canary; });
  return hit == end ? -1 : long(offset + 2 * (hit - units));
}

namespace {
// One past the last unit of [begin, end) that is not canary, as a byte offset from `base`; 0 if none.
std::size_t written_end(const std::byte *base, std::size_t begin, std::size_t end) {
  const auto *units = reinterpret_cast<const std::uint16_t *>(base);
  for (std::size_t i = canary_units(end); i > begin / 2; --i)
    if (units[i - 1] != canary) return i * 2;
  return 0;
}
}  // namespace

void Arena::release(std::size_t offset, std::size_t n) {
  released_high = std::max(released_high, written_end(host, offset, offset + n));
  fill_canary(offset, n);
}

std::size_t Arena::high_water() {
  download(0, canary_units(bytes + guard_bytes) * 2);
  return std::max(released_high, written_end(host, 0, bytes + guard_bytes));
}

long Arena::guard_damage() {
  download(bytes, guard_bytes);
  const long at = first_written(bytes, guard_bytes);
  return at < 0 ? -1 : at - long(bytes);
}

// ---- Executor ----------------------------------------------------------------------------------
struct Executor::Bound {
  const Kernel *kernel;
  float no_weight_decay = 0;  // AdamW over parameters that are not decayed
  bool accumulates = true;    // a backward that adds to the gradients whatever the micro-batch does
  double seconds = 0;         // with REMAT_PROFILE set: time spent in this call
  long calls = 0;
  double flops = 0;       // the step's kernel_flops, per call
  std::size_t bytes = 0;  // bytes of the tensors it reads and writes, per call
  std::int32_t rng_block = 0;
  std::vector<halide_buffer_t> buffers;
  std::vector<int> inputs, outputs;  // buffer arguments by kind (Device::opencl moves them)
  std::vector<std::array<halide_dimension_t, 2>> shapes;
  std::vector<void *> argv;
};

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

// ---- Offload: checkpoints and named internals to the pinned host buffer and back ------------
// CUDA: every copy runs on the copy stream, which first waits for everything queued on the compute
// stream before the step. Copy-out: copies, records `done`; the compute stream waits for that
// event only before the step after (which may reuse the memory). Fetch: copies into the restored
// tensor, records `done`; the reader waits for it. No device-wide synchronization. Other
// devices: plain copies (the host copy of the arena is the truth there).
struct Executor::Transfers {
  Transfers(const Plan &plan, Arena &arena) : plan(plan), arena(arena), bytes(plan.offload_bytes) {
    cuda_device = arena.device() == Device::cuda;
    host =
        static_cast<std::byte *>(cuda_device ? cuda::pinned_malloc(bytes) : std::aligned_alloc(arena_alignment, bytes));
    if (!host) throw std::runtime_error(fmt::format("cannot allocate {} bytes of host memory for offload", bytes));
    if (cuda_device)
      for (const Step &st : plan.train) {
        for (int t : st.offload) done[t] = cuda::event_create();
        for (auto [from, to] : st.fetch) done[to] = cuda::event_create();
      }
    if (cuda_device) ready = cuda::event_create();
  }
  ~Transfers() {
    for (auto &[t, e] : done) cuda::event_destroy(e);
    if (cuda_device) {
      cuda::event_destroy(ready);
      cuda::pinned_free(host);
    } else {
      std::free(host);
    }
  }
  std::byte *device_at(int t) const { return arena.device_data() + plan.tensors[t].offset; }

  void before(const Step &st) {
    for (int t : st.await_out)
      if (cuda_device) cuda::wait(cuda::Stream::compute, done.at(t));
    if ((!st.offload.empty() || !st.fetch.empty()) && cuda_device) {
      cuda::record(ready, cuda::Stream::compute);
      cuda::wait(cuda::Stream::copy, ready);
    }
    for (int t : st.offload) {
      std::byte *dst = host + plan.tensors[t].host_offset;
      if (cuda_device) {
        cuda::copy_to_host(dst, device_at(t), plan.tensors[t].bytes(), cuda::Stream::copy);
        cuda::record(done.at(t), cuda::Stream::copy);
      } else {
        std::memcpy(dst, device_at(t), plan.tensors[t].bytes());
      }
    }
    for (auto [from, to] : st.fetch) {
      const std::byte *src = host + plan.tensors[from].host_offset;
      if (cuda_device) {
        cuda::copy_to_device(device_at(to), src, plan.tensors[to].bytes(), cuda::Stream::copy);
        cuda::record(done.at(to), cuda::Stream::copy);
      } else {
        std::memcpy(device_at(to), src, plan.tensors[to].bytes());
      }
    }
    for (int t : st.await_in)
      if (cuda_device) cuda::wait(cuda::Stream::compute, done.at(t));
  }

  const Plan &plan;
  Arena &arena;
  std::size_t bytes;
  bool cuda_device = false;
  std::byte *host = nullptr;
  std::map<int, cuda::Event> done;  // by tensor: its copy-out (offloaded) or fetch (restored)
  cuda::Event ready{};
};

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
  gemm_warm_up();  // and MKL its per-thread buffers
  auto bind_all = [&](const std::vector<Step> &steps, std::vector<std::unique_ptr<Bound>> &calls) {
    for (const Step &st : steps)
      calls.push_back(
          bind(st, find_kernel(kernels, model_name, kernel_key(st.stage, st.variant, plan.precision)), scalars));
  };
  bind_all(plan.train, train_calls);
  bind_all(plan.optimize, optimize_calls);
  bind_all(plan.eval, eval_calls);
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

// With the free-memory check: every byte of the live tensors that the step does not write (whole
// tensors, and the parts of a flat buffer outside the views it writes), copied before the kernel
// and compared after it, so that a kernel writing into a tensor it was not given is named.
struct Executor::Untouched {
  struct Region {
    std::size_t offset, bytes;
    int tensor;
  };
  std::vector<Region> regions;
  std::vector<std::byte> before;
  void take(const Plan &plan, const Step &st, const std::vector<int> &live, const std::byte *arena) {
    std::vector<std::pair<std::size_t, std::size_t>> written;  // [begin, end) in the arena, merged
    for (const Arg &a : st.args)
      if (a.access == Access::write) {
        const std::size_t begin = plan.arena_offset(a.tensor);
        written.push_back({begin, begin + plan.tensors[a.tensor].bytes()});
      }
    std::ranges::sort(written);
    regions.clear();
    for (int t : live) {
      std::size_t at = plan.tensors[t].offset;
      const std::size_t end = at + plan.tensors[t].bytes();
      for (auto [w0, w1] : written) {
        if (w1 <= at || w0 >= end) continue;
        if (w0 > at) regions.push_back({at, w0 - at, t});
        at = std::max(at, w1);
      }
      if (at < end) regions.push_back({at, end - at, t});
    }
    before.clear();
    for (const Region &r : regions) before.insert(before.end(), arena + r.offset, arena + r.offset + r.bytes);
  }
  // The first changed byte and the tensor holding it, or {-1, -1}.
  std::pair<long, int> changed(const std::byte *arena) const {
    std::size_t at = 0;
    for (const Region &r : regions) {
      if (std::memcmp(before.data() + at, arena + r.offset, r.bytes) != 0) {
        std::size_t i = 0;
        while (before[at + i] == arena[r.offset + i]) ++i;
        return {long(r.offset + i), r.tensor};
      }
      at += r.bytes;
    }
    return {-1, -1};
  }
};

void Executor::run(Phase phase) {
  static const bool trace = std::getenv("REMAT_TRACE_HEAP") != nullptr;
  static const bool profile = std::getenv("REMAT_PROFILE") != nullptr;
  static const bool check_env = std::getenv("REMAT_CHECK_ARENA") != nullptr;
  auto &calls = phase == Phase::train ? train_calls : phase == Phase::optimize ? optimize_calls : eval_calls;
  const std::vector<Step> &steps = phase == Phase::train      ? plan.train
                                   : phase == Phase::optimize ? plan.optimize
                                                              : plan.eval;
  if (checks.free_memory && !arena.canary_filled())
    throw std::runtime_error("the free-memory check needs an arena filled with the canary (Arena::fill_canary)");
  const bool check_free = (checks.free_memory || check_env) && arena.canary_filled() && arena.device() != Device::cuda;
  std::vector<int> live;  // with the free-memory check: the root tensors live at this step
  Untouched untouched;
  if (check_free)
    for (int t = 0; t < int(plan.tensors.size()); ++t)
      if (plan.tensors[t].view_of < 0 && persistent(plan.tensors[t].role)) live.push_back(t);
  CountedHeap counting;  // any heap allocation from here on, but for the checks' own
  for (std::size_t i = 0; i < calls.size(); ++i) {
    auto &b = calls[i];
    const Step &st = steps[i];
    if (trace) std::fprintf(stderr, "kernel %s\n", b->kernel->name);
    const bool timed = profile || time_calls;
    if (observe) {
      PausedCounting paused;
      observe(phase, i, false);
    }
    const auto t0 = timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    if (transfers && phase == Phase::train) transfers->before(st);  // copies out, fetches into restored tensors
    if (check_free) {
      PausedCounting paused;
      live.insert(live.end(), st.alloc.begin(), st.alloc.end());
      untouched.take(plan, st, live, arena.data());
    }
    const bool host_driven = arena.device() == Device::opencl;
    if (host_driven)  // the host copy is the truth: Halide copies it to the device
      for (int a : b->inputs) b->buffers[a].flags |= halide_buffer_flag_host_dirty;
    int err = b->kernel->argv(b->argv.data());
    if (host_driven)
      for (int a : b->outputs) err = err ? err : halide_copy_to_host(nullptr, &b->buffers[a]);
    if (err != 0) {
      const std::string message = remat_halide_error;
      remat_halide_error[0] = 0;
      throw std::runtime_error(fmt::format("kernel {} failed (Halide error {}): {}", b->kernel->name, err, message));
    }
    {
      PausedCounting paused;
      check_after(*b, st, check_free ? &live : nullptr, untouched);
      if (observe) observe(phase, i, true);
    }
    if (finished && phase == Phase::train) finished(i);
    if (timed) {
      if (arena.device() == Device::cuda) arena.synchronize();
      b->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++b->calls;
    }
  }
  if (arena.device() == Device::cuda && !calls.empty()) {  // one look at the guard per phase
    PausedCounting paused;
    if (const long damage = arena.guard_damage(); damage >= 0)
      throw std::runtime_error(
          fmt::format("a kernel of this phase wrote past the end of the arena (byte {} beyond the "
                      "plan's {} bytes); REMAT_CUDA_SYNC=1 names it",
                      damage, arena.size()));
  }
}

// After each kernel call: the guard (host-visible arenas: always; CUDA: with REMAT_CUDA_SYNC=1,
// which first waits for the kernel so that an asynchronous fault is reported with its name), then
// the free-memory check, and the memory of the tensors that die here is refilled with the canary.
void Executor::check_after(const Bound &b, const Step &st, std::vector<int> *live_roots, const Untouched &untouched) {
  static const bool sync_each = std::getenv("REMAT_CUDA_SYNC") != nullptr;
  if (arena.device() == Device::cuda) {
    if (!sync_each) return;
    try {
      arena.synchronize();
    } catch (const std::exception &e) {
      throw std::runtime_error(fmt::format("kernel {}: {}", b.kernel->name, e.what()));
    }
  }
  if (const long damage = arena.guard_damage(); damage >= 0)
    throw std::runtime_error(
        fmt::format("kernel {} wrote past the end of the arena (byte {} beyond the plan's {} bytes)", b.kernel->name,
                    damage, arena.size()));
  if (!live_roots) return;
  if (const auto [byte, t] = untouched.changed(arena.data()); byte >= 0)
    throw std::runtime_error(fmt::format("kernel {} changed tensor {} (arena byte {}), which it does not write",
                                         b.kernel->name, name_of(plan.tensors[t].key).view(), byte));
  std::vector<int> &live = *live_roots;
  std::ranges::sort(live, {}, [&](int t) { return plan.tensors[t].offset; });
  std::size_t at = 0;
  auto check_gap = [&](std::size_t end, std::string_view after) {
    if (end <= at) return;
    if (const long hit = arena.first_written(at, end - at); hit >= 0)
      throw std::runtime_error(
          fmt::format("kernel {} wrote byte {} of the arena, which no live tensor holds (the "
                      "nearest live tensor below it is {})",
                      b.kernel->name, hit, after));
  };
  Name below = "none";
  for (int t : live) {
    check_gap(plan.tensors[t].offset, below.view());
    at = std::max(at, plan.tensors[t].offset + plan.tensors[t].bytes());
    below = name_of(plan.tensors[t].key);
  }
  check_gap(arena.size(), below.view());
  for (int t : st.free) {
    arena.release(plan.tensors[t].offset, plan.tensors[t].bytes());
    std::erase(live, t);
  }
}

namespace {
// The roofs REMAT_PROFILE compares kernels with, measured here and now on all of Halide's threads:
// the host GEMM's rate at a large square fp32 shape, and copy bandwidth over 256 MiB (bytes read
// plus bytes written).
struct Roofs {
  double gemm_gflops = 0, memory_gbps = 0;
};
Roofs measure_roofs() {
  auto best_seconds = [](auto &&run) {
    double best = 1e30;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      run();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best;
  };
  Roofs roofs;
  const int n = 1024;
  std::vector<float> a(std::size_t(n) * n, 1.f), b(a), c(a);
  GemmCall g;
  g.a = a.data(), g.b = b.data(), g.out = c.data(), g.m = g.n = g.k = n;
  roofs.gemm_gflops = 2.0 * n * n * n / best_seconds([&] { host_gemm(g); }) / 1e9;
  struct Copy {
    std::vector<std::byte> from, to;
    std::size_t chunk;
  } copy{std::vector<std::byte>(std::size_t(256) << 20, std::byte{1}), std::vector<std::byte>(std::size_t(256) << 20),
         1 << 20};
  auto task = [](void *, int i, std::uint8_t *closure) {
    Copy &c = *reinterpret_cast<Copy *>(closure);
    std::memcpy(c.to.data() + i * c.chunk, c.from.data() + i * c.chunk, c.chunk);
    return 0;
  };
  const int chunks = int(copy.from.size() / copy.chunk);
  roofs.memory_gbps =
      2.0 * double(copy.from.size()) /
      best_seconds([&] { halide_do_par_for(nullptr, task, 0, chunks, reinterpret_cast<std::uint8_t *>(&copy)); }) / 1e9;
  return roofs;
}
}  // namespace

// With REMAT_PROFILE set, per kernel on stderr: the time summed over its calls, and the rates it
// reached (GEMM and attention arithmetic per second, tensor bytes read and written per second)
// against this machine's GEMM rate and copy bandwidth.
Executor::~Executor() {
  if (!std::getenv("REMAT_PROFILE")) return;
  struct Totals {
    double seconds = 0, flops = 0, bytes = 0;
    long calls = 0;
  };
  std::map<std::string, Totals> by_kernel;
  for (auto *list : {&train_calls, &optimize_calls, &eval_calls})
    for (auto &b : *list) {
      Totals &t = by_kernel[b->kernel->name];
      t.seconds += b->seconds;
      t.calls += b->calls;
      t.flops += b->flops * double(b->calls);
      t.bytes += double(b->bytes) * double(b->calls);
    }
  const Roofs roofs = measure_roofs();
  std::fprintf(stderr, "profile: roofs on %d threads: GEMM %.1f GFLOP/s (fp32 %d^3), copy %.1f GB/s\n",
               gemm_thread_count(), roofs.gemm_gflops, 1024, roofs.memory_gbps);
  std::fprintf(stderr, "profile %-32s %9s %6s %9s %6s %8s %6s\n", "kernel", "seconds", "calls", "GFLOP/s", "%GEMM",
               "GB/s", "%copy");
  for (const auto &[name, t] : by_kernel) {
    if (!t.calls) continue;
    const double gflops = t.flops / t.seconds / 1e9, gbps = t.bytes / t.seconds / 1e9;
    std::fprintf(stderr, "profile %-32s %9.3f %6ld %9.1f %5.0f%% %8.1f %5.0f%%\n", name.c_str(), t.seconds, t.calls,
                 gflops, 100 * gflops / roofs.gemm_gflops, gbps, 100 * gbps / roofs.memory_gbps);
  }
}

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
