// Partition remat.planner:strategy: how the chain of blocks runs (rotor's operations): a Decision per
// sub-problem, the units of the chain, and the lowering of the fixed policies to a strategy.
module;
#include <algorithm>
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
// ---------------------------------------------------------------------------------------------
// The head: the model's last stage, when it can run in chunks of rows that never hold its whole
// output (the [rows, classes] logits) nor the logits' gradient. Each chunk runs its forward, the
// loss and its backward (which adds its parameters' gradients to the earlier chunks') before the
// next; the chain then ends with the head in place of the bare loss (unit n). A loose stage after
// another whose classes outnumber its input features (an LM head). Chunk c draws its dropout masks
// as a block of its own, rng_block + 64 c (units are 64 apart; the head's rng_block is the last).
// ---------------------------------------------------------------------------------------------
constexpr int head_stage(const Model &m) {
  const int s = m.n_stages - 1;
  return s < 1 || m.stages[s].checkpointable || m.classes() <= m.stages[s].in() ? -1 : s;
}
constexpr bool head_fused(const Model &m, const StagePolicies &ps) { return head_stage(m) >= 0 && !ps.unfused_head; }

// Every arena tensor (and every view of one) starts at a multiple of this many bytes.
inline constexpr std::size_t arena_alignment = 64;

// The head's chunks: about head_chunk_rows rows each (a [256, 50257] fp32 chunk of GPT-2's logits
// is 49 MiB, its whole [1024, 50257] 196 MiB: the head's chunk is most of a full plan's peak
// activations), whole samples when a layer of the head reads the sequences (attention, positions),
// each chunk's rows of the head input, its gradient, the labels and the metrics starting on an
// arena_alignment boundary; a remainder under min_kernel_rows joins the chunk before it. They
// depend on the model, batch and precision only, so the parameter gradients sum in the same order
// under every policy.
inline constexpr long long head_chunk_rows = 256;
struct RowRange {
  long long first, rows;
};
// The rows a chunk of the head's holds a multiple of: a sample's when one of its layers reads the
// sequences (a layer with a block size), else 1.
constexpr long long head_row_unit(const Model &m) {
  const Block &head = m.stages[m.n_stages - 1];
  for (int k = 0; k < head.n_layers; ++k)
    if (head.layers[k].block_size > 0) return m.rows_per_sample();
  return 1;
}
constexpr std::vector<RowRange> head_chunks(const Model &m, int batch, Precision precision) {
  const long long unit = head_row_unit(m), rows = batch * m.rows_per_sample();
  const LocalTensor x = remat::rows(key::block_input(), m.stages[m.n_stages - 1].in());
  const long long unit_bytes = unit * x.extent[0] * element_bytes(x, precision);
  long long step = 1;  // units per chunk are a multiple of it
  while ((step * unit_bytes) % arena_alignment != 0 || (step * unit * 4) % arena_alignment != 0) ++step;
  const long long chunk = std::max(step, head_chunk_rows / unit / step * step) * unit;
  std::vector<RowRange> out;
  for (long long first = 0; first < rows; first += chunk) {
    const long long n = std::min(chunk, rows - first);
    if (!out.empty() && n < min_kernel_rows)
      out.back().rows += n;
    else
      out.push_back({first, n});
  }
  return out;
}

// The chain's units: every block of every stage, but the head when it runs fused.
constexpr std::vector<Unit> units_of(const Model &m, bool fused) {
  std::vector<Unit> units;
  int index = 0;  // counts the blocks of repeat stages (-1 for the others)
  for (int s = 0; s < (fused ? head_stage(m) : m.n_stages); ++s)
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
  const std::vector<Unit> units = units_of(m, head_fused(m, ps));
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
