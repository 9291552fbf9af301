// Partition remat.planner:policies: what the policies ask of each repeat stage. Segments of the fixed
// schedules, each stage's policy (StagePolicies, the model's annotations), the budget among them.
module;
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>
export module remat.planner:policies;
import remat.tensors;

export namespace remat {

// A segment [first, last] of consecutive blocks that keeps only the input of `first`; backward
// rebuilds the segment's internals from it. Blocks outside every segment keep their internals.
struct Segment {
  int first, last;
};

constexpr int ceil_sqrt(int n) {
  int r = 0;
  while (r * r < n) ++r;
  return r;
}

constexpr std::vector<Segment> segments(Policy p, int n_blocks) {
  std::vector<Segment> out;
  if (n_blocks <= 0) return out;
  switch (p.kind) {
  case Policy::Kind::none:
  case Policy::Kind::budget: break;
  case Policy::Kind::full:
    for (int i = 0; i < n_blocks; ++i) out.push_back({i, i});
    break;
  case Policy::Kind::every_n_layers:
    for (int i = 0; i < n_blocks; i += p.n) out.push_back({i, i});
    break;
  case Policy::Kind::sqrt_n: {
    // ceil(sqrt(L)) parts of equal length (Chen et al. 2016), all but the last recomputed. The last
    // keeps its internals, as torch.utils.checkpoint.checkpoint_sequential's does: its backward
    // comes first, while only the earlier parts' inputs are kept, so the peak is the one a
    // recomputed part reaches anyway (give or take a block's internals).
    const int count = ceil_sqrt(n_blocks), length = (n_blocks + count - 1) / count;
    for (int i = 0; i + length < n_blocks; i += length) out.push_back({i, i + length - 1});
    break;
  }
  }
  return out;
}

// The policy of each stage (index = stage; loose stages ignore theirs). A single Policy converts
// to one for every stage: the trainer's --checkpoint-policy P. `unfused_head` (the policy part
// "+unfused_head") runs a chunkable head whole, as one forward, loss and backward (head_stage).
struct StagePolicies {
  std::array<Policy, max_stages> stage{};
  bool unfused_head = false;
  int ranks = 1;  // data-parallel ranks (each runs this plan)
  // ranks > 1: the MPI ring (CPUs) receives into the gradient exchange buffer, planned in the arena;
  // NCCL (GPUs) sums in place, with buffers of its own outside the arena (false)
  bool exchange_buffer = true;
  // ZeRO stage 1 (--shard-optimizer): this rank (of `ranks`) keeps and updates the AdamW moments of
  // its shard of the flat parameters only (Plan::shard)
  bool shard_optimizer = false;
  int rank = 0;
  constexpr StagePolicies() = default;
  constexpr StagePolicies(const Policy &p) {  // NOLINT: implicit on purpose
    for (Policy &s : stage) s = p;
  }
  constexpr bool operator==(const StagePolicies &) const = default;
};

// The model's own: each annotated repeat stage's policy, `fallback` (the model module's default)
// for the others.
constexpr StagePolicies annotated(const Model &m, const Policy &fallback) {
  StagePolicies out(fallback);
  for (int s = 0; s < m.n_stages; ++s)
    if (m.stages[s].annotated) out.stage[s] = m.stages[s].policy;
  return out;
}

// The budget policy among the stages' (every repeat stage must then have the same), or none.
constexpr const Policy *budget_of(const Model &m, const StagePolicies &ps) {
  const Policy *found = nullptr;
  for (int s = 0; s < m.n_stages; ++s)
    if (m.stages[s].checkpointable && ps.stage[s].kind == Policy::Kind::budget) found = &ps.stage[s];
  if (found)
    for (int s = 0; s < m.n_stages; ++s)
      if (m.stages[s].checkpointable && !(ps.stage[s] == *found))
        throw "remat planner: a memory budget is the whole model's policy; a stage cannot have another";
  return found;
}

// "selective", or per stage "s1:selective,s3:every_n_layers=2" when the repeat stages differ.
constexpr Message policies_name(const Model &m, const StagePolicies &ps) {
  int first = -1;
  bool same = true;
  for (int s = 0; s < m.n_stages; ++s)
    if (m.stages[s].checkpointable) {
      if (first < 0)
        first = s;
      else
        same = same && ps.stage[s] == ps.stage[first];
    }
  Message out;
  if (first < 0 || same) {
    out = policy_name(ps.stage[first < 0 ? 0 : first]);
  } else {
    for (int s = 0; s < m.n_stages; ++s)
      if (m.stages[s].checkpointable)
        out.append(out.size() ? "," : "").append("s").append(s).append(":").append(policy_name(ps.stage[s]));
  }
  if (ps.unfused_head) out.append("+unfused_head");
  return out;
}

}  // namespace remat
