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

using namespace remat;
using remat::runtime::Arena;
using remat::runtime::Executor;
using remat::runtime::Kernel;

namespace {

constexpr int batch = 8;

// ---- a test-only kernel: the real one, then a planted fault ----
struct Planted {
  int (*real)(void **) = nullptr;
  int call = 0, on_call = 0;  // the fault is planted on that call of the kernel (0: the first)
  int argument = -1;          // overrun: write 2 bytes past the end of this buffer argument
  std::size_t allocate = 0;   // allocate (and free) this many bytes from the heap
} planted;

int faulty_kernel(void **args) {
  const int err = planted.real(args);
  if (planted.call++ != planted.on_call) return err;
  if (planted.argument >= 0) {
    auto *buf = static_cast<halide_buffer_t *>(args[planted.argument]);
    std::memset(buf->host + buf->size_in_bytes(), 0, 2);
  }
  if (planted.allocate) {
    void *volatile p = std::malloc(planted.allocate);
    std::free(p);
  }
  return err;
}

// The kernel table with `name` replaced by the faulty kernel.
std::vector<Kernel> with_fault(std::span<const Kernel> table, const std::string &name, Planted fault) {
  std::vector<Kernel> out(table.begin(), table.end());
  auto it = std::ranges::find_if(out, [&](const Kernel &k) { return name == k.name; });
  BOOST_TEST_REQUIRE((it != out.end()), name);
  fault.real = it->argv;
  planted = fault;
  it->argv = faulty_kernel;
  return out;
}

// Position of the kernel argument the plan calls `arg`.
int argument_index(const Kernel &k, std::string_view arg) {
  const halide_filter_metadata_t *md = k.metadata();
  for (int a = 0; a < md->num_arguments; ++a)
    if (runtime::plan_argument_name(md->arguments[a].name) == arg) return a;
  return -1;
}

// A step of `plan.train` that writes a tensor whose next two bytes no live tensor holds (so an
// overrun of it lands in free memory), with the written argument; found by replaying the plan.
struct Site { int step = -1; const Arg *arg = nullptr; };
Site overrun_site(const Plan &plan) {
  std::vector<int> live;
  for (int t = 0; t < int(plan.tensors.size()); ++t)
    if (plan.tensors[t].view_of < 0 && persistent(plan.tensors[t].role)) live.push_back(t);
  for (int i = 0; i < int(plan.train.size()); ++i) {
    const Step &st = plan.train[i];
    live.insert(live.end(), st.alloc.begin(), st.alloc.end());
    for (const Arg &a : st.args) {
      const Tensor &t = plan.tensors[a.tensor];
      if (a.access != Access::write || t.view_of >= 0) continue;
      const std::size_t end = t.offset + t.bytes();
      const bool free_after = end + 2 <= plan.peak_bytes && std::ranges::none_of(live, [&](int o) {
        const Tensor &x = plan.tensors[o];
        return x.offset < end + 2 && end < x.offset + x.bytes();
      });
      if (free_after) return {i, &a};
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

}  // namespace

// A corrupted plan: the loss kernel's row_loss moved to 8 bytes before the arena's end, so the
// kernel writes past it, into the guard. The run stops there, naming the kernel.
BOOST_AUTO_TEST_CASE(a_write_past_the_plan_is_caught_in_the_guard) {
  Plan plan = make_plan(mlp::model, none, batch);
  Tensor &row_loss = plan.tensors[plan.find("row_loss")];
  BOOST_TEST_REQUIRE(row_loss.bytes() > 8u);
  row_loss.offset = plan.peak_bytes - 8;
  Arena arena(plan.peak_bytes);
  arena.fill_canary();
  runtime::Scalars scalars;
  Executor ex(plan, "mlp", mlp_kernels::table, arena, scalars);
  std::ranges::fill(ex.tensor<std::int32_t>("labels"), 0);
  try {
    ex.run(Executor::Phase::train);
    BOOST_FAIL("the write past the arena went unnoticed");
  } catch (const std::runtime_error &e) {
    BOOST_TEST(what(e).find("kernel mlp_loss wrote past the end of the arena") != std::string::npos, what(e));
  }
  BOOST_TEST(arena.high_water() > arena.size());  // the measured peak shows the violation too
}

// A test-only kernel that writes 2 bytes past one of its outputs, where no live tensor is: the
// guard cannot see it (it is inside the arena), the free-memory check names the kernel.
BOOST_AUTO_TEST_CASE(a_write_outside_the_live_tensors_is_caught) {
  for (auto [model, name, table, samples] : {std::tuple{&mlp::model, "mlp", std::span<const Kernel>(mlp_kernels::table), batch},
                                             {&gpt::model, "gpt", std::span<const Kernel>(gpt_kernels::table), 2}}) {
    const Plan plan = make_plan(*model, full, samples);
    const Site site = overrun_site(plan);
    BOOST_TEST_REQUIRE(site.step >= 0, name << ": no step writes a tensor with free memory after it");
    const Step &st = plan.train[site.step];
    const std::string kernel(kernel_name(name, st.stage, st.variant, plan.precision).view());
    const Kernel &real = *std::ranges::find_if(table, [&](const Kernel &k) { return kernel == k.name; });
    Planted fault;
    fault.on_call = calls_before(plan, site.step, name);
    fault.argument = argument_index(real, site.arg->name.view());
    BOOST_TEST_REQUIRE(fault.argument >= 0, kernel << " has no argument " << site.arg->name.view());
    const std::vector<Kernel> faulty = with_fault(table, kernel, fault);
    for (bool checked : {false, true}) {
      Arena arena(plan.peak_bytes);
      arena.fill_canary();
      runtime::Scalars scalars;
      Executor ex(plan, name, faulty, arena, scalars, {.free_memory = checked});
      std::ranges::fill(ex.tensor<std::int32_t>("labels"), 0);
      if (model->token_input()) std::ranges::fill(ex.tensor<std::int32_t>("inputs"), 0);
      planted.call = 0;
      if (!checked) {  // without the check the fault goes unseen: the run completes
        BOOST_CHECK_NO_THROW(ex.run(Executor::Phase::train));
        continue;
      }
      try {
        ex.run(Executor::Phase::train);
        BOOST_FAIL(name << ": the write outside the live tensors went unnoticed");
      } catch (const std::runtime_error &e) {
        BOOST_TEST(what(e).find("kernel " + kernel + " wrote byte") != std::string::npos, what(e));
        BOOST_TEST(what(e).find("which no live tensor holds") != std::string::npos, what(e));
      }
    }
  }
}

// The real kernels pass the free-memory check under every policy, offload and bf16 included:
// no kernel writes outside the tensors the plan gives it.
BOOST_AUTO_TEST_CASE(real_kernels_write_only_their_tensors) {
  for (Precision precision : {Precision::fp32, Precision::bf16})
    for (Policy p : {none, selective, full, Policy{Policy::Kind::every_n_layers, 2}, sqrt_n, with_offload(sqrt_n)}) {
      Run mlp_run(mlp::model, "mlp", mlp_kernels::table, p, batch, 0, true, runtime::Device::cpu, precision);
      Run gpt_run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true, runtime::Device::cpu, precision);
      for (Run *r : {&mlp_run, &gpt_run}) {
        Executor checked(r->plan, r->model.token_input() ? "gpt" : "mlp",
                         r->model.token_input() ? std::span<const Kernel>(gpt_kernels::table) : std::span<const Kernel>(mlp_kernels::table),
                         r->arena, r->scalars, {.free_memory = true});
        for (auto phase : {Executor::Phase::train, Executor::Phase::optimize, Executor::Phase::eval})
          BOOST_CHECK_NO_THROW(checked.run(phase));
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

  for (Policy p : {none, sqrt_n, with_offload(full)}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true);
    runtime::reset_step_heap();
    runtime::reset_halide_heap_peak();
    for (auto phase : {Executor::Phase::train, Executor::Phase::optimize, Executor::Phase::eval}) run.ex.run(phase);
    BOOST_TEST(runtime::step_heap().allocations == 0u, policy_name(p).view());
    BOOST_TEST(runtime::halide_heap().peak == 0u, policy_name(p).view());
  }
}
