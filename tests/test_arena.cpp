// The measured peak can show a violation of the plan: a kernel writing past the arena (into the
// guard), or outside every live tensor (the free-memory check), is caught and named, and every
// heap allocation during a phase is counted. Each check is shown to fire on a planted fault, and
// to stay quiet on the real kernels.
#include <boost/test/unit_test.hpp>

#include <HalideRuntime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>
import remat;
import remat.runtime;
import mlp;
import mlp.kernels;
import gpt;
import gpt.kernels;

#include "model_run.h"
#include "planted_fault.h"

using namespace remat;
using remat::runtime::Arena;
using remat::runtime::Executor;
using remat::runtime::Kernel;
using namespace remat::testing;

namespace {

constexpr int batch = 8;

// Where 2 bytes written just past a tensor that a train step writes land: in the guard (the
// tensor ends at the plan's peak), in free memory, in a live tensor the step does not write, or
// (past a gradient view) in the flat gradient buffer where the step writes nothing.
enum class Landing { guard, free_memory, neighbour, other_gradient };

// The first train step, and its written argument, whose overrun lands as asked (replaying the plan).
struct Site { int step = -1; const Arg *arg = nullptr; std::string neighbour; };
Site overrun_site(const Plan &plan, Landing landing) {
  std::vector<int> live;
  for (int t = 0; t < int(plan.tensors.size()); ++t)
    if (plan.tensors[t].view_of < 0 && persistent(plan.tensors[t].role)) live.push_back(t);
  for (int i = 0; i < int(plan.train.size()); ++i) {
    const Step &st = plan.train[i];
    live.insert(live.end(), st.alloc.begin(), st.alloc.end());
    auto written = [&](int t) { return std::ranges::any_of(st.args, [&](const Arg &a) { return a.access == Access::write && a.tensor == t; }); };
    auto absolute = [&](const Tensor &t) { return t.offset + (t.view_of >= 0 ? plan.tensors[t.view_of].offset : 0); };
    for (const Arg &a : st.args) {
      const Tensor &t = plan.tensors[a.tensor];
      if (landing == Landing::other_gradient && a.access == Access::write && t.role == Role::grads && t.view_of >= 0) {
        const std::size_t end = absolute(t) + t.bytes();
        const bool unwritten = std::ranges::none_of(st.args, [&](const Arg &o) {
          const Tensor &x = plan.tensors[o.tensor];
          return o.access == Access::write && absolute(x) < end + 2 && end < absolute(x) + x.bytes();
        });
        const Tensor &root = plan.tensors[t.view_of];
        if (unwritten && end + 2 <= root.offset + root.bytes()) return {i, &a, std::string(root.name.view())};
      }
      if (a.access != Access::write || t.view_of >= 0 || landing == Landing::other_gradient) continue;
      const std::size_t end = t.offset + t.bytes();
      const auto hit = std::ranges::find_if(live, [&](int o) {
        const Tensor &x = plan.tensors[o];
        return x.offset < end + 2 && end < x.offset + x.bytes();
      });
      const bool lands = landing == Landing::guard         ? end == plan.peak_bytes
                         : landing == Landing::free_memory ? end + 2 <= plan.peak_bytes && hit == live.end()
                                                           : hit != live.end() && !written(*hit);
      if (lands) return {i, &a, hit == live.end() ? "" : std::string(plan.tensors[*hit].name.view())};
    }
    for (int t : st.free) std::erase(live, t);
  }
  return {};
}

// How many earlier train steps call the same kernel as step i.
int calls_before(const Plan &plan, int i, std::string_view model) {
  const Name name = kernel_name(model, plan.train[i].stage, plan.train[i].variant, plan.precision);
  int n = 0;
  for (int j = 0; j < i; ++j) n += kernel_name(model, plan.train[j].stage, plan.train[j].variant, plan.precision) == name;
  return n;
}

std::string what(const std::exception &e) { return e.what(); }

struct Example {
  const Model *model;
  const char *name;
  std::span<const Kernel> table;
  int samples;
};
const Example examples[] = {{&mlp::model, "mlp", mlp_kernels::table, batch}, {&gpt::model, "gpt", gpt_kernels::table, 2}};

// Runs the train phase of `plan` with a test-only kernel that writes 2 bytes past the argument of
// `site`, and returns the error the executor raised ("" if none).
std::string run_with_overrun(const Example &e, const Plan &plan, const Site &site, bool free_memory_check) {
  const Step &st = plan.train[site.step];
  const std::string kernel(kernel_name(e.name, st.stage, st.variant, plan.precision).view());
  const Kernel &real = *std::ranges::find_if(e.table, [&](const Kernel &k) { return kernel == k.name; });
  Planted fault;
  fault.on_call = calls_before(plan, site.step, e.name);
  fault.argument = argument_index(real, site.arg->name.view());
  BOOST_TEST_REQUIRE(fault.argument >= 0, kernel << " has no argument " << site.arg->name.view());
  const std::vector<Kernel> faulty = with_fault(e.table, kernel, fault);
  Arena arena(plan.peak_bytes);
  arena.fill_canary();
  runtime::Scalars scalars;
  Executor ex(plan, e.name, faulty, arena, scalars, {.free_memory = free_memory_check});
  std::ranges::fill(ex.tensor<std::int32_t>("labels"), 0);
  if (e.model->token_input()) std::ranges::fill(ex.tensor<std::int32_t>("inputs"), 0);
  try {
    ex.run(Executor::Phase::train);
  } catch (const std::runtime_error &err) {
    return err.what();
  }
  return "";
}

}  // namespace

// A plan that does not fit its arena is refused before anything runs.
BOOST_AUTO_TEST_CASE(a_plan_that_does_not_fit_is_refused) {
  Plan plan = make_plan(mlp::model, none, batch);
  plan.tensors[plan.find("row_loss")].offset = plan.peak_bytes - 8;  // ends past the arena
  Arena arena(plan.peak_bytes);
  runtime::Scalars scalars;
  try {
    Executor ex(plan, "mlp", mlp_kernels::table, arena, scalars);
    BOOST_FAIL("a tensor past the arena was accepted");
  } catch (const std::runtime_error &e) {
    BOOST_TEST(what(e).find("tensor row_loss") != std::string::npos, what(e));
  }
  Arena small(plan.peak_bytes / 2);
  BOOST_CHECK_THROW(Executor(make_plan(mlp::model, none, batch), "mlp", mlp_kernels::table, small, scalars), std::runtime_error);
}

// A test-only kernel writes 2 bytes past the tensor that ends at the plan's peak: into the guard.
// The run stops after that kernel, naming it, with or without the free-memory check; the
// measured peak (the high-water mark) shows the violation too.
BOOST_AUTO_TEST_CASE(a_write_past_the_plan_is_caught_in_the_guard) {
  for (const Example &e : examples)
    for (Policy p : {none, full}) {
      const Plan plan = make_plan(*e.model, p, e.samples);
      const Site site = overrun_site(plan, Landing::guard);
      BOOST_TEST_REQUIRE(site.step >= 0, e.name << ": no step writes the tensor at the peak");
      const Step &st = plan.train[site.step];
      const std::string kernel(kernel_name(e.name, st.stage, st.variant, plan.precision).view());
      for (bool checked : {false, true}) {
        const std::string error = run_with_overrun(e, plan, site, checked);
        BOOST_TEST(error.find("kernel " + kernel + " wrote past the end of the arena") != std::string::npos,
                   e.name << " " << policy_name(p).view() << ": " << error);
      }
    }
}

// Past a tensor into free memory inside the arena: the guard cannot see it (the run completes
// without the check); the free-memory check names the kernel.
BOOST_AUTO_TEST_CASE(a_write_outside_the_live_tensors_is_caught) {
  for (const Example &e : examples) {
    const Plan plan = make_plan(*e.model, full, e.samples);
    const Site site = overrun_site(plan, Landing::free_memory);
    BOOST_TEST_REQUIRE(site.step >= 0, e.name << ": no step writes a tensor with free memory after it");
    const Step &st = plan.train[site.step];
    const std::string kernel(kernel_name(e.name, st.stage, st.variant, plan.precision).view());
    BOOST_TEST(run_with_overrun(e, plan, site, false) == "");
    const std::string error = run_with_overrun(e, plan, site, true);
    BOOST_TEST(error.find("kernel " + kernel + " wrote byte") != std::string::npos, error);
    BOOST_TEST(error.find("which no live tensor holds") != std::string::npos, error);
  }
}

// Past a tensor into the live tensor next to it, which the kernel does not write: the check names
// the kernel and the tensor it changed.
BOOST_AUTO_TEST_CASE(a_write_into_a_neighbouring_tensor_is_caught) {
  for (const Example &e : examples) {
    const Plan plan = make_plan(*e.model, none, e.samples);
    const Site site = overrun_site(plan, Landing::neighbour);
    BOOST_TEST_REQUIRE(site.step >= 0, e.name << ": no step writes a tensor followed by a live one");
    const Step &st = plan.train[site.step];
    const std::string kernel(kernel_name(e.name, st.stage, st.variant, plan.precision).view());
    const std::string error = run_with_overrun(e, plan, site, true);
    BOOST_TEST(error.find("kernel " + kernel + " changed tensor " + site.neighbour + " ") != std::string::npos,
               e.name << ": " << error);
  }
}

// The real kernels pass the free-memory check under every policy, offload and bf16 included:
// no kernel writes outside the tensors the plan gives it.
// Past a gradient view into the flat gradient buffer, where this step writes nothing (another
// block's gradients, or padding): the check names the kernel and the buffer.
BOOST_AUTO_TEST_CASE(a_write_into_another_gradient_is_caught) {
  for (const Example &e : examples) {
    const Plan plan = make_plan(*e.model, full, e.samples);
    const Site site = overrun_site(plan, Landing::other_gradient);
    BOOST_TEST_REQUIRE(site.step >= 0, e.name << ": no step writes a gradient view followed by one it does not write");
    const Step &st = plan.train[site.step];
    const std::string kernel(kernel_name(e.name, st.stage, st.variant, plan.precision).view());
    const std::string error = run_with_overrun(e, plan, site, true);
    BOOST_TEST(error.find("kernel " + kernel + " changed tensor grads ") != std::string::npos, e.name << ": " << error);
  }
}

BOOST_AUTO_TEST_CASE(real_kernels_write_only_their_tensors) {
  for (Precision precision : {Precision::fp32, Precision::bf16})
    for (Policy p : {none, selective, full, Policy{Policy::Kind::every_n_layers, 2}, sqrt_n, with_offload(sqrt_n)}) {
      Run mlp_run(mlp::model, "mlp", mlp_kernels::table, p, batch, 0, true, runtime::Device::cpu, precision);
      Run gpt_run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true, runtime::Device::cpu, precision);
      for (Run *r : {&mlp_run, &gpt_run}) {
        Executor checked(r->plan, r->model.token_input() ? "gpt" : "mlp",
                         r->model.token_input() ? std::span<const Kernel>(gpt_kernels::table) : std::span<const Kernel>(mlp_kernels::table),
                         r->arena, r->scalars, {.free_memory = true});
        for (auto phase : {Executor::Phase::train, Executor::Phase::optimize, Executor::Phase::eval}) try {
            checked.run(phase);
          } catch (const std::exception &e) {
            BOOST_ERROR(policy_name(p).view() << " " << precision_name(precision) << ": " << e.what());
          }
        BOOST_TEST_CONTEXT(policy_name(p).view() << " " << precision_name(precision)) {
          BOOST_TEST(r->arena.high_water() == r->plan.peak_bytes);
        }
      }
    }
}

// Heap allocations during a phase are counted, whoever makes them (here a planted malloc inside
// a kernel call); the real kernels, the executor and the offload transfers make none.
BOOST_AUTO_TEST_CASE(heap_allocations_during_steps_are_counted) {
  const Plan plan = make_plan(mlp::model, full, batch);
  Planted fault;
  fault.allocate = 1000;
  const std::vector<Kernel> faulty = with_fault(mlp_kernels::table, "mlp_loss", fault);
  Arena arena(plan.peak_bytes);
  runtime::Scalars scalars;
  Executor ex(plan, "mlp", faulty, arena, scalars);
  std::ranges::fill(ex.tensor<std::int32_t>("labels"), 0);
  runtime::reset_step_heap();
  ex.run(Executor::Phase::train);
  BOOST_TEST(runtime::step_heap().allocations >= 1u);
  BOOST_TEST(runtime::step_heap().bytes >= 1000u);

  for (Policy p : {none, selective, sqrt_n, with_offload(full)}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true);
    runtime::reset_step_heap();
    runtime::reset_halide_heap_peak();
    for (auto phase : {Executor::Phase::train, Executor::Phase::optimize, Executor::Phase::eval}) run.ex.run(phase);
    BOOST_TEST(runtime::step_heap().allocations == 0u, policy_name(p).view());
    BOOST_TEST(runtime::halide_heap().peak == 0u, policy_name(p).view());
  }
}
