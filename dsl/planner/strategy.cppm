// Partition remat.planner:strategy: how the chain of blocks runs (rotor's operations): a Decision per
// sub-problem, the units of the chain, and the lowering of the fixed policies to a strategy.
module;
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>
export module remat.planner:strategy;
import remat.tensors;
import :policies;

export namespace remat {

// ---------------------------------------------------------------------------------------------
// Strategies: how the chain runs (the operations of rotor, Beaumont et al. 2019, "Optimal
// checkpointing for heterogeneous chains"). The chain is every block of every stage in order
// (units 0..n-1), then the loss (unit n). Sub-problem (s, t) runs the backward of units s..t
// given the input of s (kept by its caller) and the gradient of t's output (for t = n the loss
// makes it), and ends with the gradient of s's input; it frees the input of s.
// ---------------------------------------------------------------------------------------------
struct Decision {
  enum class Op : std::uint8_t {
    keep,        // forward s keeping internals (`keep`: all or selective); solve (s+1, t); backward s
    checkpoint,  // forward s..until-1 keeping only the input of `until` (a checkpoint); solve
                 // (until, t); then solve (s, until-1) again from the input of s
    recompute,   // s == t: backward s with its whole forward fused in, from its input
    loss,        // s == t == n
    unset,
  } op = Op::unset;
  Keep keep = Keep::all;
  int until = 0;
  bool offload = false;  // checkpoint: the input of s waits in pinned host memory meanwhile
  constexpr bool operator==(const Decision &) const = default;
};

struct Strategy {
  int n = 0;                    // units before the loss
  std::vector<Decision> table;  // sub-problem (s, t) at s * (n + 1) + t
  constexpr explicit Strategy(int units = 0) : n(units) {
    table.reserve(std::size_t((n + 1) * (n + 1)));
    for (int i = 0; i < (n + 1) * (n + 1); ++i) table.push_back({});
  }
  constexpr Decision &at(int s, int t) { return table[std::size_t(s * (n + 1) + t)]; }
  constexpr const Decision &at(int s, int t) const { return table[std::size_t(s * (n + 1) + t)]; }
  constexpr bool operator==(const Strategy &) const = default;
};

// One unit of the chain: stage, block within it, whether its stage is a repeat stage.
struct Unit {
  int stage, block, index, rng;
};
constexpr std::vector<Unit> units_of(const Model &m) {
  std::vector<Unit> units;
  int index = 0;  // counts the blocks of repeat stages (-1 for the others)
  for (int s = 0; s < m.n_stages; ++s)
    for (int b = 0; b < m.stages[s].repeat; ++b)
      units.push_back({s, b, m.stages[s].checkpointable ? index++ : -1, int(units.size()) * 64});
  return units;
}

// The kernels the model compiler makes for a stage: every variant for repeat stages; forward_save,
// forward_discard and backward_saved for loose ones (generators/modelc.cpp, StageKernels).
constexpr bool has_kernel(const Model &m, int stage, Variant v) {
  if (m.stages[stage].checkpointable) return true;
  return v == Variant::forward_save || v == Variant::forward_discard || v == Variant::backward_saved;
}

// The strategy of the fixed policies: segments() of each repeat stage, whose first block's input
// is a checkpoint and whose other blocks are rebuilt (keeping everything) before their backward;
// blocks outside segments keep their internals (selectively under a selective policy).
constexpr Strategy lower(const Model &m, const StagePolicies &ps) {
  const std::vector<Unit> units = units_of(m);
  const int n = int(units.size());
  Strategy st(n);
  st.at(n, n).op = Decision::Op::loss;
  std::vector<Segment> segs;
  for (int s = 0, first = 0; s < m.n_stages; first += m.stages[s].repeat, ++s)
    if (m.stages[s].checkpointable)
      for (Segment g : segments(ps.stage[s], m.stages[s].repeat)) segs.push_back({first + g.first, first + g.last});
  std::vector<int> in_segment;
  for (int u = 0; u < n; ++u) in_segment.push_back(-1);
  for (int k = 0; k < int(segs.size()); ++k)
    for (int u = segs[k].first; u <= segs[k].last; ++u) in_segment[u] = k;
  for (int u = 0; u < n; ++u) {
    const Policy &p = ps.stage[units[u].stage];
    if (in_segment[u] < 0) {
      st.at(u, n) = {Decision::Op::keep, p.selective && units[u].index >= 0 ? Keep::selective : Keep::all};
      continue;
    }
    const Segment g = segs[in_segment[u]];
    if (g.first != u) continue;
    st.at(u, n) = {Decision::Op::checkpoint, Keep::all, g.last + 1, p.offload && u > 0};
    for (int r = g.first; r < g.last; ++r) st.at(r, g.last) = {Decision::Op::keep, Keep::all};
    st.at(g.last, g.last).op = Decision::Op::recompute;
  }
  return st;
}

}  // namespace remat
