// --memory-timeline FILE: every allocation and free of the arena over the run's first training step,
// written as the pickle torch.cuda.memory._snapshot() returns, so that PyTorch's memory viewer
// (pytorch.org/memory_viz, torch/cuda/_memory_viz.py) draws remat's step as it draws a PyTorch one.
//
// Recorded from the executor as it runs (Executor::observe), not derived from the plan's steps
// alone: the executor knows which step it is in, so the record is what ran, in the order and at
// the times the kernels ran: every micro-batch of the step, then the optimizer.
//
// What the file holds:
// - the segment of the arena (address: its base; its size and guard region), with what stays live
//   after the step allocated in it: the parameters, gradients, AdamW moments, batch and metrics;
// - the trace (device 0): those persistent tensors' allocations, then for every kernel call the
//   tensors that become live before it ('alloc') and those that die after it ('free_requested',
//   'free_completed'), at address arena base + planned offset; each event's frames say the tensor
//   as the plan report names it and the phase: {filename: kernel, line: step of the plan, name:
//   "s1.b3.h2 (forward)"}, then {filename: program, line: micro-batch, name: the tensor's role}.
//   The phases are forward, recompute (a forward run again, or the internals a backward kernel
//   rebuilds), backward and optimizer; AdamW works in place on the flat buffers, so no tensor is
//   allocated in the optimizer phase;
// - the arena's holes: the bytes below the top of the live tensors that no live tensor holds
//   (alignment and first-fit placement), as allocations of their own named "arena hole", so that
//   the live bytes at any moment are the arena's top then, and their maximum the planned peak;
// - what the measured peak holds beyond the plan's tensors, each an allocation over the whole step
//   as measured_peak_bytes counts it: bytes kernels wrote above the planned peak (the arena's high
//   water above it; past the arena's size, in the guard region), the peak of the Halide heap
//   (halide_malloc) and, on the CPU, the step's heap allocations, each named "... (measured)".
//   They are 0 on a sound build and then absent; the last two are outside the arena, in a segment
//   of their own past it (the addresses are not real ones);
// - "remat": the run (model, policy, precision, batch, micro-batches) and its peaks, which PyTorch's
//   tools ignore.
// The maximum of the live bytes over the trace is the run's measured_peak_bytes.
module;
#include <fmt/format.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
module remat.trainer;
import remat;

namespace remat::runtime {
namespace {

// A pickle (protocol 2) of dicts, lists, tuples, strings and integers: all a snapshot holds.
class Pickle {
public:
  Pickle() { out = "\x80\x02"; }  // PROTO 2
  template <std::integral T>
  Pickle &integer(T value) {
    const long long v = static_cast<long long>(value);
    if (v >= INT32_MIN && v <= INT32_MAX) {
      out += 'J';  // BININT: 4 bytes, little-endian
      raw(std::uint32_t(std::int32_t(v)), 4);
    } else {
      out += "\x8a\x08";  // LONG1, 8 bytes, little-endian two's complement
      raw(std::uint64_t(v), 8);
    }
    return *this;
  }
  Pickle &text(std::string_view s) {
    out += 'X';  // BINUNICODE: 4-byte length, UTF-8
    raw(s.size(), 4);
    out += s;
    return *this;
  }
  Pickle &pair(long long a, long long b) {
    integer(a).integer(b);
    out += '\x86';  // TUPLE2
    return *this;
  }
  // A dict or a list whose items `items` writes (key, value, key, value...; or values).
  template <class F>
  Pickle &dict(F items) {
    out += "}(";  // EMPTY_DICT, MARK ... SETITEMS
    items();
    out += 'u';
    return *this;
  }
  template <class F>
  Pickle &list(F items) {
    out += "](";  // EMPTY_LIST, MARK ... APPENDS
    items();
    out += 'e';
    return *this;
  }
  Pickle &key(std::string_view k) { return text(k); }
  std::string finish() { return out + '.'; }  // STOP

private:
  std::string out;
  void raw(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out += char((v >> (8 * i)) & 0xff);
  }
};

struct Frame {
  std::string filename;
  long line = 0;
  std::string name;
};
// A trace entry; `addr` is an offset from the arena's base until written.
struct Event {
  std::string_view action;
  std::size_t addr = 0, size = 0;
  long long time_us = 0;
  std::vector<Frame> frames;
};

long long now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string_view role_name(Role r) {
  switch (r) {
  case Role::params: return "parameters";
  case Role::grads: return "gradients";
  case Role::adam_m: return "AdamW first moments";
  case Role::adam_v: return "AdamW second moments";
  case Role::data: return "batch";
  case Role::block_input: return "block input";
  case Role::internal: return "internal saved for backward";
  case Role::recomputed: return "recomputed internal or kernel scratch";
  case Role::gradient: return "gradient between blocks";
  case Role::scratch: return "backward workspace";
  case Role::metrics: return "per-row metrics";
  case Role::exchange: return "gradient exchange (data-parallel)";
  }
  return "?";
}

// forward / recompute / backward / optimizer: the step's; in a backward kernel that recomputes,
// the internals it rebuilds are recompute.
std::string_view phase_of(const Step &st, const Tensor *t) {
  if (st.variant == Variant::adamw) return "optimizer";
  if (is_backward(st.variant)) return t && t->role == Role::recomputed ? "recompute" : "backward";
  return st.recompute ? "recompute" : "forward";
}

void write_frames(Pickle &p, const std::vector<Frame> &frames) {
  p.list([&] {
    for (const Frame &f : frames)
      p.dict([&] { p.key("filename").text(f.filename).key("line").integer(f.line).key("name").text(f.name); });
  });
}

}  // namespace

struct MemoryTimeline::Recorder {
  const Plan &plan;
  std::string program, kernel_prefix;
  std::vector<Event> events;
  std::map<std::size_t, std::pair<std::size_t, int>> live;  // offset -> end, tensor (roots)
  std::set<std::pair<std::size_t, std::size_t>> holes;      // [begin, end) below the top
  long micro = 0;
  std::size_t before_step = 0;  // events: the persistent tensors' first

  // The tensor's frames at step `at` of `steps` (none: before the step).
  std::vector<Frame> frames(int t, const std::vector<Step> *steps, std::size_t at) const {
    const Tensor &x = plan.tensors[t];
    const std::string name(name_of(x.key).view());
    if (!steps)
      return {{program, 0, fmt::format("{} (persistent)", name)}, {program, 0, std::string(role_name(x.role))}};
    const Step &st = (*steps)[at];
    return {{kernel(st), long(at), fmt::format("{} ({})", name, phase_of(st, &x))},
            {program, micro, std::string(role_name(x.role))}};
  }
  std::string kernel(const Step &st) const {
    return std::string(name_of(kernel_prefix, kernel_key(st.stage, st.variant, plan.precision)).view());
  }
  void alloc(std::size_t offset, std::size_t bytes, long long time, std::vector<Frame> frames) {
    events.push_back({"alloc", offset, bytes, time, std::move(frames)});
  }
  void free(std::size_t offset, std::size_t bytes, long long time, const std::vector<Frame> &frames) {
    for (std::string_view action : {"free_requested", "free_completed"})
      events.push_back({action, offset, bytes, time, frames});
  }
  // A hole's frames: made or gone at step `at` (or before the step, or at its end).
  std::vector<Frame> hole_frames(const Step *st, std::size_t at, std::string_view when = "persistent") const {
    return {{st ? kernel(*st) : program, long(at),
             fmt::format("arena hole: below the top, no live tensor (alignment, first-fit) ({})",
                         st ? phase_of(*st, nullptr) : when)},
            {program, micro, "arena hole"}};
  }
  // The tensors `ts` become live (alloc) or die; the holes follow. Holes that are gone are freed
  // first and new ones allocated last, so the live bytes never pass the larger of the arena's top
  // before and after.
  void change(const std::vector<int> &ts, bool alloc_them, const std::vector<Step> *steps, std::size_t at) {
    const long long time = now_us();
    std::vector<int> changed;
    for (int t : ts) {
      const Tensor &x = plan.tensors[t];
      const std::size_t offset = plan.arena_offset(t);
      if (x.bytes() == 0) continue;
      if (alloc_them) {
        if (!live.emplace(offset, std::pair{offset + x.bytes(), t}).second)
          throw std::logic_error(
              fmt::format("memory timeline: {} starts where a live tensor is", name_of(x.key).view()));
      } else {  // as the planner's placement: a tensor dies once
        const auto it = live.find(offset);
        if (it == live.end() || it->second.second != t) continue;
        live.erase(it);
      }
      changed.push_back(t);
    }
    std::set<std::pair<std::size_t, std::size_t>> now_holes;
    std::size_t top = 0;
    for (const auto &[offset, range] : live) {
      if (offset > top) now_holes.insert({top, offset});
      top = std::max(top, range.first);
    }
    const Step *st = steps ? &(*steps)[at] : nullptr;
    for (const auto &h : holes)
      if (!now_holes.contains(h)) free(h.first, h.second - h.first, time, hole_frames(st, at));
    for (int t : changed) {
      const Tensor &x = plan.tensors[t];
      if (alloc_them)
        alloc(plan.arena_offset(t), x.bytes(), time, frames(t, steps, at));
      else
        free(plan.arena_offset(t), x.bytes(), time, frames(t, steps, at));
    }
    for (const auto &h : now_holes)
      if (!holes.contains(h)) alloc(h.first, h.second - h.first, time, hole_frames(st, at));
    holes = std::move(now_holes);
  }
};

namespace {

// What the measured peak counts beyond the plan's tensors, live over the whole step.
struct Extra {
  std::size_t offset, bytes;  // from the arena's base
  std::string name;
};

// What was recorded, beside the snapshot's own keys (PyTorch's viewer ignores others).
struct Recorded {
  std::string_view program, model, policy;
  const Plan &plan;
  long micro_batches;
  MeasuredPeak measured;
};

// The snapshot: the arena's segment (and, when the measured peak has any, the segment of what lies
// outside it), its blocks as the step leaves them, the trace, and what was recorded.

std::string snapshot(const std::vector<Event> &events, std::size_t base, std::size_t arena_bytes,
                     const std::vector<Extra> &outside, const Recorded &run) {
  // the blocks at the end: what was allocated and not freed
  std::map<std::size_t, const Event *> allocated;
  for (const Event &e : events)
    if (e.action == "alloc")
      allocated[e.addr] = &e;
    else if (e.action == "free_completed")
      allocated.erase(e.addr);
  struct Segment {
    std::size_t offset, bytes;
    std::vector<Frame> frames;
  };
  std::vector<Segment> segments = {{0, arena_bytes + Arena::guard_bytes, {}}};
  if (!outside.empty()) {
    const std::size_t end = outside.back().offset + outside.back().bytes;
    segments.push_back({outside.front().offset,
                        end - outside.front().offset,
                        {{"remat", 0, "outside the arena: what the measured peak counts (address not real)"}}});
  }
  Pickle p;
  auto blocks = [&](const Segment &seg, std::size_t &active) {
    std::size_t at = seg.offset;
    auto block = [&](std::size_t bytes, const Event *e) {
      p.dict([&] {
        p.key("address").integer(base + at).key("size").integer(bytes);
        p.key("requested_size").integer(bytes);
        p.key("state").text(e ? "active_allocated" : "inactive").key("frames");
        write_frames(p, e ? e->frames : std::vector<Frame>{});
      });
      at += bytes;
    };
    for (auto it = allocated.lower_bound(seg.offset); it != allocated.end() && it->first < seg.offset + seg.bytes;
         ++it) {
      if (it->first > at) block(it->first - at, nullptr);
      block(it->second->size, it->second);
      active += it->second->size;
    }
    if (at < seg.offset + seg.bytes) block(seg.offset + seg.bytes - at, nullptr);
  };
  p.dict([&] {
    p.key("segments").list([&] {
      for (const Segment &seg : segments)
        p.dict([&] {
          std::size_t active = 0;
          p.key("device").integer(0).key("address").integer(base + seg.offset);
          p.key("total_size").integer(seg.bytes).key("stream").integer(0);
          p.key("segment_type").text("large").key("segment_pool_id").pair(0, 0).key("frames");
          write_frames(p, seg.frames);
          p.key("blocks").list([&] { blocks(seg, active); });
          for (const char *k : {"allocated_size", "active_size", "requested_size"}) p.key(k).integer(active);
        });
    });
    p.key("remat").dict([&] {
      p.key("program").text(run.program).key("model").text(run.model).key("policy").text(run.policy);
      p.key("precision").text(precision_name(run.plan.precision)).key("batch_size").integer(run.plan.batch);
      p.key("micro_batches").integer(run.micro_batches).key("planned_peak_bytes").integer(run.plan.peak_bytes);
      p.key("measured_peak_bytes").integer(run.measured.total());
      p.key("arena_high_water_bytes").integer(run.measured.arena_high_water);
      p.key("halide_heap_peak_bytes").integer(run.measured.halide_heap_peak);
      p.key("step_heap_bytes").integer(run.measured.step_heap_bytes);
    });
    p.key("device_traces").list([&] {
      p.list([&] {
        for (const Event &e : events)
          p.dict([&] {
            p.key("action").text(e.action).key("addr").integer(base + e.addr).key("size").integer(e.size);
            p.key("stream").integer(0).key("time_us").integer(e.time_us);
            p.key("frames");
            write_frames(p, e.frames);
          });
      });
    });
  });
  return p.finish();
}

}  // namespace

MemoryTimeline::MemoryTimeline(std::string path_, std::string program_)
    : path(std::move(path_)), program(std::move(program_)) {
  check_writable(path, "--memory-timeline");  // now, before the engine allocates
}

MemoryTimeline::~MemoryTimeline() {
  if (engine) engine->executor.observe = nullptr;
}

void MemoryTimeline::start(Engine &e, std::string_view model_name, std::string_view policy_) {
  engine = &e;
  model = model_name;
  policy = policy_;
  const Plan &plan = e.plan;
  r = std::make_unique<Recorder>(Recorder{plan, program, std::string(model_name)});
  std::vector<int> persistent_roots;
  for (int t = 0; t < int(plan.tensors.size()); ++t)
    if (plan.tensors[t].view_of < 0 && persistent(plan.tensors[t].role)) persistent_roots.push_back(t);
  r->change(persistent_roots, true, nullptr, 0);
  r->before_step = r->events.size();
  e.executor.observe = [this](Executor::Phase phase, std::size_t step, bool done) {
    if (phase == Executor::Phase::eval) return;
    const std::vector<Step> &steps = phase == Executor::Phase::train ? r->plan.train : r->plan.optimize;
    if (phase == Executor::Phase::train && step == 0 && !done) ++r->micro;
    r->change(done ? steps[step].free : steps[step].alloc, !done, &steps, step);
  };
}

void MemoryTimeline::finish(const MeasuredPeak &measured) {
  engine->executor.observe = nullptr;
  Recorder &rec = *r;
  const long long started = rec.events.front().time_us, ended = now_us();
  // the step is over: its holes go (the persistent tensors stay)
  for (const auto &[begin, end] : rec.holes)
    rec.free(begin, end - begin, ended, rec.hole_frames(nullptr, 0, "end of step"));
  // What the measured peak counts beyond the plan's tensors, over the whole step as it counts them.
  const std::size_t planned = rec.plan.peak_bytes, arena_bytes = engine->arena.size();
  std::vector<Extra> inside, outside;
  if (measured.arena_high_water > planned)
    inside.push_back({planned, measured.arena_high_water - planned,
                      measured.arena_high_water > arena_bytes
                          ? "written past the arena into its guard region: the high water above the planned peak"
                          : "written above the planned peak: the arena's high water above it"});
  std::size_t past = align_up(arena_bytes + Arena::guard_bytes);  // past the arena's allocation
  for (auto [bytes, name] :
       {std::pair{measured.halide_heap_peak, "Halide heap: the peak of halide_malloc over the step"},
        {measured.step_heap_bytes, "heap allocations during the step: malloc, frees not tracked"}})
    if (bytes > 0) {
      outside.push_back({past, bytes, fmt::format("{}, outside the arena, address not real", name)});
      past += align_up(bytes);
    }
  auto frames = [&](const Extra &x) {
    return std::vector<Frame>{{program, 0, fmt::format("{} (measured)", x.name)}, {program, 0, "measured"}};
  };
  // the persistent tensors, the extras, the step, the extras' frees
  std::vector<Event> events(rec.events.begin(), rec.events.begin() + long(rec.before_step));
  for (const auto *list : {&inside, &outside})
    for (const Extra &x : *list) events.push_back({"alloc", x.offset, x.bytes, started, frames(x)});
  events.insert(events.end(), rec.events.begin() + long(rec.before_step), rec.events.end());
  for (const auto *list : {&inside, &outside})
    for (const Extra &x : *list)
      for (std::string_view action : {"free_requested", "free_completed"})
        events.push_back({action, x.offset, x.bytes, ended, frames(x)});
  const Recorded run = {rec.program, model, policy, rec.plan, rec.micro, measured};
  const std::string bytes = snapshot(events, std::size_t(engine->arena.device_data()), arena_bytes, outside, run);
  write_atomically(path, "--memory-timeline", [&](std::ostream &out) { out.write(bytes.data(), long(bytes.size())); });
}

}  // namespace remat::runtime
