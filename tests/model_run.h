// One micro-batch of a model through the executor, on the CPU or a CUDA device: deterministic
// parameters, inputs and labels (the same for every policy and device), the gradients read back.
// Include after `import remat; import remat.runtime;`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

struct Run {
  const remat::Model &model;
  remat::runtime::Engine engine;
  const remat::Plan &plan;
  remat::runtime::Arena &arena;
  remat::runtime::Scalars &scalars;
  remat::runtime::Executor &ex;
  // canary: the arena starts filled with the canary (NaN) pattern, so a kernel reading a tensor
  // that nothing wrote shows in the gradients
  Run(const remat::Model &m, std::string_view name, std::span<const remat::runtime::Kernel> kernels,
      remat::StagePolicies p, int samples, double dropout = 0, bool canary = false,
      remat::runtime::Device device = remat::runtime::Device::cpu, remat::Precision precision = remat::Precision::fp32,
      const remat::CostModel &costs = {})
      : model(m),
        engine(remat::make_plan(m, p, samples, precision, costs), name, kernels, {.device = device, .canary = canary}),
        plan(engine.plan),
        arena(engine.arena),
        scalars(engine.scalars),
        ex(engine.executor) {
    using namespace remat;
    // parameters, their gradients (the alignment padding between parameters is never written by
    // a kernel) and the AdamW moments start at zero, as the trainer's do
    const remat::TensorId flat[] = {plan.params(), plan.grads(), plan.adam_m(), plan.adam_v()};
    for (remat::TensorId t : flat) std::ranges::fill(ex.tensor<float>(t), 0.f);
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int i = 0; i < int(plan.tensors.size()); ++i)
      if (const Tensor &t = plan.tensors[i]; t.role == Role::params && t.key.layer >= 0) {
        // random biases and gains around their trained start, so that every term of a rule shows
        const float scale = t.init == Init::uniform_fan_in ? 1.f / std::sqrt(float(t.extent[1])) : 0.2f;
        for (float &x : ex.tensor<float>(TensorId{i})) x = scale * u(rng) + (t.init == Init::ones ? 1.f : 0.f);
      }
    if (m.token_input())
      for (auto &t : ex.tensor<std::int32_t>(plan.inputs())) t = int(rng() % m.input.vocab);
    else {
      std::vector<float> images(plan.tensors[plan.inputs().index].bytes() / ex.element_size(plan.inputs()));
      for (float &x : images) x = 0.5f * (u(rng) + 1);
      ex.set_values(plan.inputs(), images);
    }
    auto labels = ex.tensor<std::int32_t>(plan.labels());
    for (std::size_t b = 0; b < labels.size(); ++b) labels[b] = int((b * 7 + 3) % m.classes());
    for (remat::TensorId t : flat) ex.upload(t);
    ex.upload(plan.inputs());
    ex.upload(plan.labels());
    scalars.grad_scale = 1.f / float(plan.rows);
    scalars.seed = 1234;
    scalars.step = 3;
    scalars.set_dropout(dropout);
  }
  std::vector<float> read(remat::TensorId tensor) {
    ex.download(tensor);
    auto g = ex.tensor<float>(tensor);
    return {g.begin(), g.end()};
  }
  std::vector<float> grads() { return read(plan.grads()); }
};
