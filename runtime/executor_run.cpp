// The executor, running: each step's kernel called with the checks around it (the guard, the
// free-memory check, REMAT_CUDA_SYNC), the observers, the offload copies, the heap counted.
module;
#include <HalideRuntime.h>
#include <fmt/format.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module remat.runtime;
import remat;

extern "C" std::atomic<bool> remat_heap_counting;
extern "C" char remat_halide_error[1024];

namespace remat::runtime {

namespace {
struct PausedCounting {
  PausedCounting() { remat_heap_counting = false; }
  ~PausedCounting() { remat_heap_counting = true; }
};
}  // namespace

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
    int err = b->skipped ? 0 : b->kernel->argv(b->argv.data());
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
}  // namespace remat::runtime
