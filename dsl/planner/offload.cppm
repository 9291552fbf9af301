// Partition remat.planner:offload: the transfers of offloaded tensors (checkpoints, and internals a
// stage's policy names for offload) between the arena and pinned host memory, as the step builder
// schedules them.
module;
#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>
export module remat.planner:offload;
import remat.tensors;
import :plan;

// Not exported: the step builder's.
namespace remat::detail {

// A tensor x is copied out before the kernel of step `at` (a checkpoint: the forward that reads
// it; an internal: the step after the forward that made it), so that the copy overlaps that step;
// x dies after it, and the next step waits for the copy before anything can reuse the memory.
// When the schedule reaches the step that reads x next, a restored copy is allocated one step
// earlier (the fetch overlaps that step) and awaited by the reader.
struct Transfers {
  std::vector<std::pair<int, int>> offloaded{};  // {tensor, step at}
  std::vector<std::pair<int, int>> restored{};   // {restored tensor, original}

  constexpr void offload(int x, int at) { offloaded.push_back({x, at}); }
  // Called when the schedule reaches the step that reads x next (about to be pushed): the tensor
  // that step reads, a restored copy added to the plan (x itself where x was not offloaded, or where
  // no step would lie between x's death and the restored copy's allocation: offloading would save
  // nothing, and x stays in the arena).
  constexpr int bring_back(Plan &plan, int x) {
    const auto it = std::find_if(offloaded.begin(), offloaded.end(), [&](auto o) { return o.first == x; });
    if (it == offloaded.end()) return x;
    if (int(plan.train.size()) < it->second + 3) {
      offloaded.erase(it);
      return x;
    }
    plan.tensors.push_back(plan.tensors[x]);
    const int r = int(plan.tensors.size()) - 1;
    restored.push_back({r, original(x)});
    return r;
  }
  // The tensor whose host copy a restored copy came from (itself for others).
  constexpr int original(int x) const {
    for (auto [r, from] : restored)
      if (r == x) return from;
    return x;
  }
  // After the schedule is built: place the frees, waits and fetches described above, and the
  // host copies in the pinned buffer.
  constexpr void schedule(Plan &plan) const {
    auto &train = plan.train;
    for (auto [x, at] : offloaded) {
      train[at].free.push_back(x);
      // a restored copy offloaded again (a nested checkpoint): the host still holds the original
      if (original(x) != x) continue;
      train[at].offload.push_back(x);
      if (at + 1 < int(train.size())) train[at + 1].await_out.push_back(x);
      plan.tensors[x].host_offset = plan.offload_bytes;
      plan.offload_bytes += align_up(plan.tensors[x].bytes());
    }
    for (auto [r, x] : restored) {
      int reader = -1;
      for (int i = 0; i < int(train.size()) && reader < 0; ++i)
        for (const Arg &a : train[i].args)
          if (a.tensor == r) reader = i;
      const int fetch_at = std::max(reader - 1, 0);
      train[fetch_at].alloc.insert(train[fetch_at].alloc.begin(), r);
      train[fetch_at].fetch.push_back({x, r});
      train[reader].await_in.push_back(r);
    }
  }
};

}  // namespace remat::detail
