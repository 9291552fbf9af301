// The Engine: construction and parameter init (snapshots: trainer/snapshot.cpp).
module;
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>
module remat.runtime;
import remat;

namespace remat::runtime {
namespace {
// U(-1, 1) from 53 random bits
float uniform(std::mt19937_64 &rng) { return float(double(rng() >> 11) * 0x1.0p-53 * 2.0 - 1.0); }
}  // namespace

namespace {
Arena &with_canary(Arena &arena, bool canary) {
  if (canary) arena.fill_canary();
  return arena;
}
}  // namespace

Engine::Engine(Plan p, std::string_view name, std::span<const Kernel> kernels, Options options)
    : model_name(name),
      plan(std::move(p)),
      arena(std::max(plan.peak_bytes, plan.eval_peak_bytes), options.device),
      executor(plan, model_name, kernels, with_canary(arena, options.canary), scalars, options.checks) {}

void Engine::init_params(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const TensorId flat[] = {plan.params(), plan.grads(), plan.adam_m(), plan.adam_v()};
  for (TensorId t : flat) std::ranges::fill(executor.tensor<float>(t), 0.f);
  for (int i = 0; i < int(plan.tensors.size()); ++i) {
    const Tensor &t = plan.tensors[i];
    if (t.role != Role::params || t.key.layer < 0) continue;  // a layer's parameter (not a flat range)
    auto values = executor.tensor<float>(TensorId{i});
    switch (t.init) {
    case Init::uniform_fan_in: {
      const float bound = 1.f / std::sqrt(float(t.extent[1]));
      for (float &v : values) v = bound * uniform(rng);
      break;
    }
    case Init::ones: std::ranges::fill(values, 1.f); break;
    case Init::zeros: break;
    }
  }
  for (TensorId t : flat) executor.upload(t);
}

}  // namespace remat::runtime
