// The measured peak can show a violation of the plan: a kernel writing past the arena (into the
// guard), or anywhere but its outputs (the free-memory check), is caught and named, and every
// heap allocation during a phase is counted. On every test model (tests/registry.h). Each check is shown to fire on
// a planted fault, and to stay quiet on the real kernels.
#include <boost/test/unit_test.hpp>

#include <HalideRuntime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>
#include <boost/test/data/test_case.hpp>

#include <ostream>
#include "registry.h"

#include "compare.h"
#include "model_run.h"
#include "planted_fault.h"
#include "policies.h"

using namespace remat;
using remat::runtime::Arena;
using remat::runtime::Executor;
using remat::runtime::Kernel;
using namespace remat::testing;

namespace {
// A CPU plan in fp32.
Plan cpu_plan(const Model &m, Policy p, int batch) { return make_plan(m, p, batch, Precision::fp32); }
}  // namespace

namespace {

constexpr int batch = 8;

std::string what(const std::exception &e) { return e.what(); }

// Runs the train phase of `plan` with a test-only kernel that writes 2 bytes past the argument of
// `site`, and returns the error the executor raised ("" if none).
std::string run_with_overrun(const TestModel &e, const Plan &plan, const Site &site, bool free_memory_check) {
  const std::vector<Kernel> faulty = with_overrun(e.cpu, site);
  Arena arena(plan.peak_bytes);
  arena.fill_canary();
  runtime::Scalars scalars;
  Executor ex(plan, e.name, faulty, arena, scalars, {.free_memory = free_memory_check});
  std::ranges::fill(ex.tensor<std::int32_t>(plan.labels()), 0);
  if (e.model.token_input()) std::ranges::fill(ex.tensor<std::int32_t>(plan.inputs()), 0);
  try {
    ex.run(Executor::Phase::train);
  } catch (const std::runtime_error &err) { return err.what(); }
  return "";
}

}  // namespace

// A plan that does not fit its arena is refused before anything runs.
BOOST_AUTO_TEST_CASE(a_plan_that_does_not_fit_is_refused) {
  Plan plan = cpu_plan(mlp::model, none, batch);
  plan.tensors[plan.row_loss().index].offset = plan.peak_bytes - 8;  // ends past the arena
  Arena arena(plan.peak_bytes);
  runtime::Scalars scalars;
  try {
    Executor ex(plan, "mlp", mlp_kernels::table, arena, scalars);
    BOOST_FAIL("a tensor past the arena was accepted");
  } catch (const std::runtime_error &e) { BOOST_TEST(what(e).find("tensor row_loss") != std::string::npos, what(e)); }
  Arena small(plan.peak_bytes / 2);
  BOOST_CHECK_THROW(Executor(cpu_plan(mlp::model, none, batch), "mlp", mlp_kernels::table, small, scalars),
                    std::runtime_error);
}

// A plan of fewer rows than the kernels' minimum (their GEMM row tiles) is refused, as is a
// step whose arguments are not its kernel's (a stale kernel table): both before anything runs.
BOOST_AUTO_TEST_CASE(a_plan_the_kernels_cannot_run_is_refused) {
  const Plan few = cpu_plan(mlp::model, none, min_kernel_rows - 1);  // one row per sample
  try {
    runtime::Engine engine(few, "mlp", mlp_kernels::table);
    BOOST_FAIL("a plan of " << few.rows << " rows was accepted");
  } catch (const std::runtime_error &e) {
    BOOST_TEST(what(e).find("the kernels need at least 8") != std::string::npos, what(e));
  }
  Plan stale = cpu_plan(mlp::model, none, batch);
  stale.train[0].args.pop_back();  // the stem's forward, one buffer short
  try {
    runtime::Engine engine(stale, "mlp", mlp_kernels::table);
    BOOST_FAIL("a step with an argument missing was accepted");
  } catch (const std::runtime_error &e) { BOOST_TEST(what(e).find("(a stale build?)") != std::string::npos, what(e)); }
  Plan swapped = cpu_plan(mlp::model, none, batch);
  std::swap(swapped.train[0].args.front(), swapped.train[0].args.back());  // a read where a write is
  try {
    runtime::Engine engine(swapped, "mlp", mlp_kernels::table);
    BOOST_FAIL("a step with its arguments out of order was accepted");
  } catch (const std::runtime_error &e) {
    BOOST_TEST(what(e).find("is not the written buffer") != std::string::npos, what(e));
  }
}

// A test-only kernel writes 2 bytes past the tensor that ends at the plan's peak: into the guard.
// The run stops after that kernel, naming it, with or without the free-memory check; the
// measured peak (the high-water mark) shows the violation too.
BOOST_AUTO_TEST_CASE(a_write_past_the_plan_is_caught_in_the_guard) {
  // test_cuda's device version plants the same fault in the GPT's library-GEMM plan
  BOOST_TEST(overrun_site(make_plan(gpt::model, none, 2, Precision::fp32), Landing::guard, "gpt").step >= 0);
  for (const TestModel &e : test_models())
    for (Policy p : {none, full}) {
      const Plan plan = cpu_plan(e.model, p, e.samples[0]);
      const Site site = overrun_site(plan, Landing::guard, e.name);
      BOOST_TEST_REQUIRE(site.step >= 0, e.name << ": no step writes the tensor at the peak");
      for (bool checked : {false, true}) {
        const std::string error = run_with_overrun(e, plan, site, checked);
        BOOST_TEST(error.find("kernel " + site.kernel + " wrote past the end of the arena") != std::string::npos,
                   e.name << " " << policy_name(p).view() << ": " << error);
      }
    }
}

// Past a tensor into free memory inside the arena: the guard cannot see it (the run completes
// without the check); the free-memory check names the kernel.
BOOST_AUTO_TEST_CASE(a_write_outside_the_live_tensors_is_caught) {
  for (const TestModel &e : test_models()) {
    const Plan plan = cpu_plan(e.model, full, e.samples[0]);
    const Site site = overrun_site(plan, Landing::free_memory, e.name);
    BOOST_TEST_REQUIRE(site.step >= 0, e.name << ": no step writes a tensor with free memory after it");
    BOOST_TEST(run_with_overrun(e, plan, site, false) == "");
    const std::string error = run_with_overrun(e, plan, site, true);
    BOOST_TEST(error.find("kernel " + site.kernel + " wrote byte") != std::string::npos, error);
    BOOST_TEST(error.find("which no live tensor holds") != std::string::npos, error);
  }
}

// Past a tensor into the live tensor next to it, which the kernel does not write: the check names
// the kernel and the tensor it changed. (Not every plan has such a step: zoo_gated's first-fit
// layout leaves a gap or its own output after every written tensor; the examples' do.)
BOOST_AUTO_TEST_CASE(a_write_into_a_neighbouring_tensor_is_caught) {
  int planted = 0;
  for (const TestModel &e : test_models()) {
    const Plan plan = cpu_plan(e.model, none, e.samples[0]);
    const Site site = overrun_site(plan, Landing::neighbour, e.name);
    if (site.step < 0) {
      BOOST_TEST(!e.example, e.name << ": no step writes a tensor followed by a live one");
      continue;
    }
    ++planted;
    const std::string error = run_with_overrun(e, plan, site, true);
    BOOST_TEST(error.find("kernel " + site.kernel + " changed tensor " + site.neighbour + " ") != std::string::npos,
               e.name << ": " << error);
  }
  BOOST_TEST(planted >= 3);
}

// Past a gradient view into the flat gradient buffer, where this step writes nothing (another
// block's gradients, or padding): the check names the kernel and the buffer.
BOOST_AUTO_TEST_CASE(a_write_into_another_gradient_is_caught) {
  for (const TestModel &e : test_models()) {
    const Plan plan = cpu_plan(e.model, full, e.samples[0]);
    const Site site = overrun_site(plan, Landing::other_gradient, e.name);
    BOOST_TEST_REQUIRE(site.step >= 0, e.name << ": no step writes a gradient view followed by one it does not write");
    const std::string error = run_with_overrun(e, plan, site, true);
    BOOST_TEST(error.find("kernel " + site.kernel + " changed tensor grads ") != std::string::npos,
               e.name << ": " << error);
  }
}

// The guarantees, one case per (test model, micro-batch, precision, policy): the real kernels of the
// registry's models (tests/registry.h: the examples, a model unlike them, the model zoo) under
// every policy of policies_for (offload and budgets included): no kernel writes outside the tensors
// the plan gives it (the free-memory check), the measured peak is the planned one, no step
// allocates from the heap (Halide's or any other), and every policy gives the gradients of `none`
// bit for bit.
namespace {
struct GuaranteeCase {
  const TestModel *model;
  int samples;
  Precision precision;
  PolicyCase policy;
  bool first;  // the first case of its (model, micro-batch, precision): none, whose gradients the others match
};
std::ostream &operator<<(std::ostream &out, const GuaranteeCase &c) {
  return out << c.model->name << " batch " << c.samples << " " << precision_name(c.precision) << " "
             << c.policy.label(c.model->model);
}
std::vector<GuaranteeCase> guarantee_cases() {
  std::vector<GuaranteeCase> out;
  for (const TestModel &m : test_models())
    for (int samples : m.samples)
      for (Precision precision : {Precision::fp32, Precision::bf16}) {
        bool first = true;
        for (const PolicyCase &p : policies_for(m.model, samples, precision)) {
          out.push_back({&m, samples, precision, p, first});
          first = false;
        }
      }
  return out;
}
// The gradients of each (model, micro-batch, precision) under none (its first case).
std::map<std::string, std::vector<float>> &expected_gradients() {
  static std::map<std::string, std::vector<float>> by_run;
  return by_run;
}
int offloading_budgets = 0, offloading_others = 0;  // runs whose plan offloads

}  // namespace

BOOST_DATA_TEST_CASE(real_kernels_keep_the_guarantees, boost::unit_test::data::make(guarantee_cases()), c) {
  const TestModel &e = *c.model;
  const std::string run_key =
      std::string(e.name) + " " + std::to_string(c.samples) + " " + std::string(precision_name(c.precision));
  Run run(e.model, e.name, e.cpu, c.policy.policies, c.samples, e.dropout, true, runtime::Device::cpu, c.precision,
          c.policy.costs);
  Executor checked(run.plan, e.name, e.cpu, run.arena, run.scalars, {.free_memory = true});
  runtime::reset_step_heap();
  runtime::reset_halide_heap_peak();
  for (auto phase : {Executor::Phase::train, Executor::Phase::optimize, Executor::Phase::eval}) try {
      checked.run(phase);
      if (phase == Executor::Phase::train) {
        const std::vector<float> got = run.grads();
        if (c.first) expected_gradients()[run_key] = got;
        const std::vector<float> &expected = expected_gradients().at(run_key);
        BOOST_TEST(finite_and_nonzero(got));
        BOOST_TEST(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0);
      }
    } catch (const std::exception &error) { BOOST_ERROR(error.what()); }
  BOOST_TEST(run.arena.high_water() == run.plan.peak_bytes);
  if (run.plan.offload_bytes > 0) ++(c.policy.costs.transfer_rate > 0 ? offloading_budgets : offloading_others);
  if (const Policy *b = budget_of(e.model, c.policy.policies))
    BOOST_TEST((long long)run.plan.peak_bytes <= b->budget_bytes);
  BOOST_TEST(runtime::step_heap().allocations == 0u);
  BOOST_TEST(runtime::halide_heap().peak == 0u);
}

// After the cases above (Boost runs a file's cases in order): the budget planner offloaded
// somewhere, and the offload policies and zoo_gated's annotation did.
BOOST_AUTO_TEST_CASE(some_guarantee_runs_offload) {
  BOOST_TEST(offloading_budgets > 0);
  BOOST_TEST(offloading_others > int(test_models().size()) * 2);
  BOOST_TEST_MESSAGE("runs that offload: " << offloading_budgets << " budget plans, " << offloading_others
                                           << " others");
}

// Heap allocations during a phase are counted, whoever makes them (here a planted malloc inside
// a kernel call; that the real kernels make none is in real_kernels_keep_the_guarantees).
BOOST_AUTO_TEST_CASE(heap_allocations_during_steps_are_counted) {
  const Plan plan = cpu_plan(mlp::model, full, batch);
  Planted fault;
  fault.allocate = 1000;
  const std::vector<Kernel> faulty =
      with_fault(mlp_kernels::table, kernel_key(-1, Variant::loss, Precision::fp32), fault);
  Arena arena(plan.peak_bytes);
  runtime::Scalars scalars;
  Executor ex(plan, "mlp", faulty, arena, scalars);
  std::ranges::fill(ex.tensor<std::int32_t>(plan.labels()), 0);
  runtime::reset_step_heap();
  ex.run(Executor::Phase::train);
  BOOST_TEST(runtime::step_heap().allocations >= 1u);
  BOOST_TEST(runtime::step_heap().bytes >= 1000u);
}

// A fused head (head_stage: unusual's last stage, linear(36, 40), in two chunks at 96 samples)
// gives the gradients and per-row losses of the same model run with +unfused_head, up to the order
// in which its chunks add up the head's parameter gradients (a sum over rows split in two): within
// 1e-6 of the largest gradient in fp32 and bf16 (measured on an AMD EPYC: 1.0e-7 and 5.1e-8; the
// chunks' per-row values, the head input's gradient among them, came out equal).
BOOST_AUTO_TEST_CASE(the_fused_head_gives_the_unfused_heads_gradients) {
  const TestModel &e = test_model("unusual");
  const int samples = 96;
  BOOST_TEST_REQUIRE(head_stage(e.model) == e.model.n_stages - 1);
  for (Precision precision : {Precision::fp32, Precision::bf16}) {
    BOOST_TEST_REQUIRE(head_chunks(e.model, samples, precision).size() > 1u);
    StagePolicies unfused(none);
    unfused.unfused_head = true;
    Run fused_run(e.model, e.name, e.cpu, none, samples, e.dropout, true, runtime::Device::cpu, precision);
    Run unfused_run(e.model, e.name, e.cpu, unfused, samples, e.dropout, true, runtime::Device::cpu, precision);
    fused_run.ex.run(Executor::Phase::train);
    unfused_run.ex.run(Executor::Phase::train);
    const Tolerance tol{1e-6, 0};
    const std::vector<float> got = fused_run.grads(), ref = unfused_run.grads();
    BOOST_TEST(finite_and_nonzero(ref));
    const Comparison grads = compare(got, ref, tol);
    BOOST_TEST(grads.mismatches == 0u, precision_name(precision) << " gradients: " << grads.describe());
    const Comparison loss = compare(fused_run.read(fused_run.plan.row_loss()),
                                    unfused_run.read(unfused_run.plan.row_loss()), Tolerance{1e-6, 0});
    BOOST_TEST(loss.mismatches == 0u, precision_name(precision) << " row losses: " << loss.describe());
    BOOST_TEST_MESSAGE(precision_name(precision) << ": worst gradient difference " << grads.worst_of_scale
                                                 << " of the largest gradient, row loss " << loss.worst_of_scale);
  }
}
