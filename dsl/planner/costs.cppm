// Partition remat.planner:costs: the chain the budget planner sees. Kernel costs (measured or estimated),
// and per unit of the chain the bytes and seconds of each way it can run (chain_of, from the
// kernels' signatures as the step builder binds them).
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>
export module remat.planner:costs;
import remat.tensors;
import :strategy;
import :plan;
import :builder;

export namespace remat {

// The seconds of one kernel call: measured (--calibrate) when the table has the kernel, else an
// estimate from its arithmetic (kernel_flops) and the bytes of its arguments.
struct KernelTime {
  KernelKey kernel;
  double seconds = 0;
};
struct CostModel {
  double flop_rate = 5e10;  // flop/s
  double byte_rate = 1e10;  // bytes/s of arguments read and written
  double launch = 5e-6;     // seconds per call
  // bytes/s each way between device memory and pinned host memory; 0: checkpoints are not
  // offloaded (the CPU, whose arena is host memory already)
  double transfer_rate = 0;
  std::vector<KernelTime> measured{};
  constexpr double seconds(const KernelKey &kernel, double flops, double bytes) const {
    for (const KernelTime &k : measured)
      if (k.kernel == kernel) return k.seconds;
    return flops / flop_rate + bytes / byte_rate + launch;
  }
};

// One unit of the chain as the dynamic program sees it: bytes as the arena holds them (each
// tensor aligned), per Keep (all, selective, nothing).
struct Link {
  int stage = -1;
  long long x = 0;                           // its input (0: the batch, which is persistent)
  long long y = 0;                           // its output
  long long dx = 0;                          // its input's gradient (0: none); for the loss, the logits' gradient
  std::array<long long, 3> saved{};          // internals its forward keeps
  std::array<long long, 3> forward_temp{};   // a forward's short-lived tensors (scratch, workspace)
  std::array<long long, 3> backward_temp{};  // a backward's ([nothing]: the fused recompute's)
  std::array<double, 3> forward_time{}, backward_time{};  // loss: forward_time[0]
  std::array<bool, 3> can{};  // keep all, keep selective, recompute: whether the kernels exist
  double offload_time = -1;   // seconds to copy its input out and back (< 0: not offloaded)
  // the loss unit only: its steps, and the bytes its last step holds above x and dx (a fused head:
  // three steps per chunk, the last chunk's backward last; an offloaded checkpoint's fetch
  // overlaps that step)
  int steps = 1;
  long long last_temp = 0;
};
struct Chain {
  std::vector<Link> links;   // the units, then the loss
  long long persistent = 0;  // parameters, gradients, moments, batch, metrics
  constexpr int n() const { return int(links.size()) - 1; }
  // whether some checkpoint may wait in host memory (the costs carry a transfer rate)
  constexpr bool offloadable() const {
    return std::ranges::any_of(links, [](const Link &l) { return l.offload_time >= 0; });
  }
};

// The loss unit of a fused head (head_stage): dx is the head input's gradient, forward_temp[0] the
// most bytes one chunk holds at once (its largest), last_temp what the last chunk's backward holds,
// forward_time[0] the head's two kernels' over every chunk (the caller adds one loss kernel's).
template <class Kernel>
constexpr Link head_link(const Model &m, const detail::Builder &b, Kernel &&kernel) {
  Link l;
  const int s = head_stage(m);
  const std::vector<RowRange> chunks = head_chunks(m, b.batch, b.precision);
  struct ChunkCost {
    long long y = 0, saved = 0, forward_temp = 0, dlogits = 0, backward_temp = 0;
    double seconds = 0;
  };
  auto chunk_cost = [&](long long rows) {
    ChunkCost c;
    c.seconds = kernel(
        s, Variant::forward_save,
        [&](ArgRole r, long long n) {
          if (r == ArgRole::block_output) c.y += n;
          if (r == ArgRole::saved) c.saved += n;
          if (r == ArgRole::scratch || r == ArgRole::workspace) c.forward_temp += n;
        },
        rows);
    kernel(
        -1, Variant::loss,
        [&](ArgRole r, long long n) {
          if (r == ArgRole::input_grad) c.dlogits += n;
        },
        rows);
    c.seconds += kernel(
        s, Variant::backward_saved,
        [&](ArgRole r, long long n) {
          if (r == ArgRole::scratch || r == ArgRole::workspace) c.backward_temp += n;
        },
        rows);
    return c;
  };
  // every chunk but the last has the first's rows; the last is shorter, or longer when a remainder
  // joined it
  const ChunkCost first = chunk_cost(chunks.front().rows);
  const ChunkCost last = chunks.size() > 1 ? chunk_cost(chunks.back().rows) : first;
  const ChunkCost &big = chunks.back().rows > chunks.front().rows ? last : first;
  // the head input's gradient, whole: each chunk's backward writes its rows
  const LocalTensor dx = rows(key::input_grad(), m.stages[s].in());
  l.dx = (long long)align_up(std::size_t(dx.elements(b.n_rows) * element_bytes(dx, b.precision)));
  l.forward_temp[0] =
      big.saved + std::max({big.y + big.forward_temp, big.y + big.dlogits, big.dlogits + big.backward_temp});
  l.forward_time[0] = first.seconds * double(chunks.size() - 1) + last.seconds;
  l.steps = 3 * int(chunks.size());
  l.last_temp = last.saved + last.dlogits + last.backward_temp;
  return l;
}

constexpr Chain chain_of(const Model &m, int batch, Precision precision, const CostModel &costs = {},
                         const StagePolicies &policies = {}) {
  detail::Builder b{m, policies, Strategy{}, batch, precision};
  b.setup();
  Chain c;
  c.persistent = (long long)b.persistent_bytes();
  const long long rows = b.n_rows;
  auto bytes = [&](const KernelArg &a, long long n_rows) {
    return (long long)align_up(std::size_t(a.tensor.elements(n_rows) * element_bytes(a.element)));
  };
  // Counts the kernel's tensors by role (at `n_rows` rows); returns its estimated or measured seconds.
  auto kernel = [&](int stage, Variant v, auto &&count, long long n_rows = 0) {
    const std::vector<KernelArg> sig = signature(m, stage, v, precision);
    double moved = 0;
    for (const KernelArg &a : sig)
      if (!a.is_scalar()) {
        moved += double(bytes(a, rows));
        count(a.role, bytes(a, n_rows ? n_rows : rows));
      }
    const double flops = stage >= 0 ? kernel_flops(m.stages[stage], v, rows) : 0;
    return costs.seconds(kernel_key(stage, v, precision), flops, moved);
  };
  for (const Unit &u : b.units) {
    Link l;
    l.stage = u.stage;
    l.x = c.links.empty() ? 0 : c.links.back().y;
    if (costs.transfer_rate > 0 && l.x > 0) l.offload_time = 2.0 * double(l.x) / costs.transfer_rate;
    for (Keep keep : {Keep::all, Keep::selective, Keep::nothing}) {
      const int k = int(keep);
      l.can[k] = has_kernel(m, u.stage, backward_variant(keep));
      if (!has_kernel(m, u.stage, forward_variant(keep))) continue;
      l.forward_time[k] = kernel(u.stage, forward_variant(keep), [&](ArgRole r, long long n) {
        if (r == ArgRole::block_output) l.y = n;
        if (r == ArgRole::saved) l.saved[k] += n;
        if (r == ArgRole::scratch || r == ArgRole::workspace) l.forward_temp[k] += n;
      });
      if (!l.can[k]) continue;
      l.backward_time[k] = kernel(u.stage, backward_variant(keep), [&](ArgRole r, long long n) {
        if (r == ArgRole::input_grad) l.dx = n;
        if (r == ArgRole::scratch || r == ArgRole::workspace) l.backward_temp[k] += n;
      });
    }
    c.links.push_back(l);
  }
  c.links.push_back(head_fused(m, policies) ? head_link(m, b, kernel) : Link{});
  Link &loss = c.links.back();
  loss.x = c.links[c.links.size() - 2].y;
  loss.forward_time[0] += kernel(-1, Variant::loss, [&](ArgRole r, long long n) {
    if (r == ArgRole::input_grad && !head_fused(m, policies)) loss.dx = n;
  });
  return c;
}

}  // namespace remat
