// The memory timeline (trainer/timeline.cpp, the trainer's --memory-timeline) of one
// training step on every test model (tests/registry.h: the examples, a model unlike them, the
// zoo) under every policy of policies_for (offload and budgets included), fp32 and bf16: the
// snapshot's live bytes peak at the measured peak, and what stays live is the persistent tensors.
// A heap allocation planted in a kernel is counted in the measured peak and shows in the timeline
// as an allocation of its own.
#include <boost/test/data/test_case.hpp>
#include <boost/test/unit_test.hpp>

#include <filesystem>
#include <ostream>
#include <string>
#include <unistd.h>
#include <vector>
#include "registry.h"
import remat.trainer;

#include "model_run.h"
#include "planted_fault.h"
#include "policies.h"
#include "snapshot.h"

using namespace remat;
using namespace remat::testing;
using remat::runtime::MeasuredPeak;
using remat::runtime::MemoryTimeline;

namespace {

std::filesystem::path scratch_file() {
  return std::filesystem::temp_directory_path() / ("remat-test-timeline-" + std::to_string(::getpid()) + ".pickle");
}

// One step of `run` (its micro-batch, then AdamW) recorded, the measured peak as the trainer
// measures it (the arena's high water, the Halide heap's peak, the step's heap bytes), and the
// snapshot read back.
std::pair<MeasuredPeak, nlohmann::json> recorded_step(Run &run, std::string_view model) {
  MemoryTimeline timeline(scratch_file().string(), "test_timeline");
  runtime::reset_step_heap();
  runtime::reset_halide_heap_peak();
  timeline.start(run.engine, model, policies_name(run.model, run.plan.policies).view());
  run.engine.train();
  run.engine.optimize();
  const MeasuredPeak measured{run.arena.high_water(), runtime::halide_heap().peak, runtime::step_heap().bytes};
  timeline.finish(measured);
  return {measured, read_pickle(scratch_file())};
}

struct TimelineCase {
  const TestModel *model;
  Precision precision;
  PolicyCase policy;
};
std::ostream &operator<<(std::ostream &out, const TimelineCase &c) {
  return out << c.model->name << " " << precision_name(c.precision) << " " << c.policy.label(c.model->model);
}
std::vector<TimelineCase> timeline_cases() {
  std::vector<TimelineCase> out;
  for (const TestModel &m : test_models())
    for (Precision precision : {Precision::fp32, Precision::bf16})
      for (const PolicyCase &p : policies_for(m.model, m.samples[0], precision)) out.push_back({&m, precision, p});
  return out;
}

}  // namespace

BOOST_DATA_TEST_CASE(the_timeline_peaks_at_the_measured_peak, boost::unit_test::data::make(timeline_cases()), c) {
  const TestModel &e = *c.model;
  Run run(e.model, e.name, e.cpu, c.policy.policies, e.samples[0], e.dropout, true, runtime::Device::cpu, c.precision,
          c.policy.costs);
  const auto [measured, snapshot] = recorded_step(run, e.name);
  const Replay replay = remat::testing::replay(snapshot);
  BOOST_TEST(measured.total() == run.plan.peak_bytes);  // the real kernels keep the plan
  BOOST_TEST(replay.peak == (long long)measured.total());
  BOOST_TEST(snapshot["segments"].size() == 1u);  // the arena alone
  for (const auto &[addr, alloc] : replay.live)
    BOOST_TEST(alloc["frames"][0]["name"].get<std::string>().ends_with(" (persistent)"), alloc.dump());
  BOOST_TEST(replay.phases.contains("forward"));
  BOOST_TEST(replay.phases.contains("backward"));
}

// A kernel that allocates from the heap (a planted malloc in the loss kernel): the step's heap
// bytes are part of the measured peak, and the timeline shows them as an allocation of their own,
// over the whole step, in a segment past the arena.
BOOST_AUTO_TEST_CASE(heap_the_measured_peak_counts_is_in_the_timeline) {
  const TestModel &e = test_model("mlp");
  Planted fault;
  fault.allocate = 100000;
  const std::vector<runtime::Kernel> faulty = with_fault(e.cpu, kernel_key(-1, Variant::loss, Precision::fp32), fault);
  Run run(e.model, e.name, faulty, full, e.samples[0], 0, true);
  const auto [measured, snapshot] = recorded_step(run, e.name);
  std::filesystem::remove(scratch_file());
  BOOST_TEST(measured.step_heap_bytes >= fault.allocate);
  BOOST_TEST(measured.arena_high_water == run.plan.peak_bytes);
  const Replay replay = remat::testing::replay(snapshot);
  BOOST_TEST(replay.peak == (long long)measured.total());
  BOOST_TEST_REQUIRE(snapshot["segments"].size() == 2u);  // the arena, and what lies outside it
  BOOST_TEST(replay.names.contains(
      "heap allocations during the step: malloc, frees not tracked, outside the arena, address not real"));
  BOOST_TEST(replay.phases.contains("measured"));
  long long heap = 0;
  for (const nlohmann::json &ev : snapshot["device_traces"][0])
    if (ev["action"] == "alloc" && ev["frames"][0]["name"].get<std::string>().starts_with("heap allocations"))
      heap += ev["size"].get<long long>();
  BOOST_TEST(heap == (long long)measured.step_heap_bytes);
}
