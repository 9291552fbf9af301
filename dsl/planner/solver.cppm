// Partition remat.planner:solver: the budget planner's solvers on the chain. least_memory (the
// strategy of least peak, exactly) and fastest_within (the fastest strategy within a budget: the
// dynamic program of Beaumont et al., its table holding a Decision per cell).
module;
#include <algorithm>
#include <array>
#include <cstddef>
#include <utility>
#include <vector>
export module remat.planner:solver;
import remat.tensors;
import :strategy;
import :costs;
import :memory;

export namespace remat {

struct BudgetSolution {
  Strategy strategy{};
  bool feasible = false;
  long long peak = 0;  // persistent + evaluate(...).peak: the plan's peak when placement leaves no holes
  double seconds = 0;  // predicted forward + loss + backward time
  long long unit = 1;  // the table's memory unit in bytes (sizes are rounded up to it)
};

// The strategy of least peak (ties: least time), exactly: a peak composes by max and +, so the
// least peak of (s, t) follows from its sub-problems' least peaks.
constexpr BudgetSolution least_memory(const Chain &c) {
  const int n = c.n();
  const std::vector<Link> &L = c.links;
  Strategy st(n);
  std::vector<Outcome> best;
  for (int i = 0; i < (n + 1) * (n + 1); ++i) best.push_back({});
  auto at = [&](int s, int t) -> Outcome & { return best[std::size_t(s * (n + 1) + t)]; };
  for (int len = 0; len <= n; ++len)
    for (int s = 0; s + len <= n; ++s) {
      const int t = s + len;
      Outcome o{-1, 0};
      Decision pick;
      auto offer = [&](Outcome cand, Decision dec) {
        if (o.peak < 0 || cand.peak < o.peak || (cand.peak == o.peak && cand.seconds < o.seconds)) {
          o = cand;
          pick = dec;
        }
      };
      if (s == n) {
        offer({loss_peak(c), L[n].forward_time[0]}, {Decision::Op::loss});
      } else {
        if (s == t && L[s].can[2]) offer({recompute_peak(c, s, t), L[s].backward_time[2]}, {Decision::Op::recompute});
        for (int k = 0; k < 2; ++k) {
          if (!L[s].can[k]) continue;
          Outcome cand{keep_peak(c, s, t, k), L[s].forward_time[k] + L[s].backward_time[k]};
          if (s < t) {
            cand.peak = std::max(cand.peak, keep_held(c, s, k) + at(s + 1, t).peak);
            cand.seconds += at(s + 1, t).seconds;
          }
          offer(cand, {Decision::Op::keep, Keep(k)});
        }
        long long sweep = 0;
        double sweep_time = 0;
        for (int u = s + 1; u <= t; ++u) {
          sweep = std::max(sweep, sweep_peak(c, s, t, u - 1));
          sweep_time += L[u - 1].forward_time[2];
          const Outcome later = at(u, t), again = at(s, u - 1);
          offer({std::max({sweep, L[s].x + later.peak, again.peak}), sweep_time + later.seconds + again.seconds},
                {Decision::Op::checkpoint, Keep::all, u});
        }
      }
      at(s, t) = o;
      st.at(s, t) = pick;
    }
  const Outcome top = at(0, n);
  return {st, true, c.persistent + top.peak, top.seconds, 1};  // (decisions of unreached sub-problems are never read)
}

constexpr long long gcd(long long a, long long b) {
  while (b) {
    const long long r = a % b;
    a = b;
    b = r;
  }
  return a;
}

}  // namespace remat

// Not exported: the budget solver's table.
namespace remat::detail {

// The chain in the table's memory unit: the greatest common divisor of the chain's sizes (exact)
// or, where that makes the table too large for the chain's length, budget / max_slots (sizes
// rounded up: the plans found fit, a few near the budget may be missed).
struct Quantized {
  Chain chain;     // every size in units, rounded up
  long long unit;  // bytes
  int slots;       // the memory available above the persistent bytes, in units
};
constexpr Quantized quantize(const Chain &c, long long avail, int classes) {
  long long g = 0;
  for (const Link &l : c.links) {
    for (long long v : {l.x, l.y, l.dx}) g = gcd(g, v);
    for (int k = 0; k < 3; ++k)
      for (long long v : {l.saved[k], l.forward_temp[k], l.backward_temp[k]}) g = gcd(g, v);
  }
  if (g == 0) g = 1;
  const int n = c.n();
  const double work = classes * double(n + 1) * (n + 1) * (n + 3) / 6.0;
  const long long max_slots = std::clamp((long long)(2e7 / work), 32LL, 4096LL);
  long long unit = g;
  if (avail / unit > max_slots) unit = (avail + max_slots - 1) / max_slots;
  Quantized q{c, unit, int(avail / unit)};
  for (Link &l : q.chain.links) {
    for (long long *v : {&l.x, &l.y, &l.dx}) *v = (*v + unit - 1) / unit;
    for (int k = 0; k < 3; ++k)
      for (long long *v : {&l.saved[k], &l.forward_temp[k], &l.backward_temp[k]}) *v = (*v + unit - 1) / unit;
  }
  return q;
}

// The dynamic program of Beaumont et al. over sub-problems (s, t) and the memory m left (in
// units): per cell and class k of the way unit s's last backward runs (keep all, keep selective,
// recompute; the loss for s = n), the best time and the Decision that reaches it. One class where
// no checkpoint can be offloaded (the best of the three); three where one can, since an offloaded
// checkpoint's fetch lands beside that last step, whose bytes the class fixes.
class FastestTable {
public:
  static constexpr double inf = 1e300;
  struct Cell {
    double seconds = inf;
    Decision decision{};  // unset: no strategy fits
  };

  constexpr FastestTable(const Chain &exact, Quantized q, int classes)
      : L(exact.links), units(std::move(q.chain)), n(exact.n()), M(q.slots), K(classes) {
    const std::size_t count = std::size_t((n + 1) * (n + 1)) * std::size_t(M + 1);
    cells.reserve(count * std::size_t(K));
    for (std::size_t i = 0; i < count * std::size_t(K); ++i) cells.push_back({});
    best.reserve(count);
    for (std::size_t i = 0; i < count; ++i) best.push_back(inf);
  }
  // Every sub-problem, the shorter ones first.
  constexpr void fill() {
    for (int len = 0; len <= n; ++len)
      for (int s = 0; s + len <= n; ++s) fill(s, s + len);
  }
  constexpr bool feasible() const { return best_of(0, n, M) < inf; }
  // The strategy the decisions of the best cell of (0, n) lead to.
  constexpr Strategy strategy() const {
    Strategy st(n);
    rebuild(st, 0, n, M, best_class(0, n, M));
    return st;
  }

private:
  constexpr std::size_t index(int s, int t, long long m) const {
    return std::size_t(s * (n + 1) + t) * std::size_t(M + 1) + std::size_t(m);
  }
  constexpr Cell &at(int s, int t, long long m, int k) {
    return cells[std::size_t(K) * index(s, t, m) + std::size_t(k % K)];
  }
  constexpr const Cell &at(int s, int t, long long m, int k) const {
    return cells[std::size_t(K) * index(s, t, m) + std::size_t(k % K)];
  }
  constexpr double best_of(int s, int t, long long m) const { return best[index(s, t, m)]; }
  constexpr int best_class(int s, int t, long long m) const {
    int k = 0;
    for (int j = 1; j < K; ++j)
      if (at(s, t, m, j).seconds < at(s, t, m, k).seconds) k = j;
    return k;
  }
  // The last backward class of (v, t)'s best time within m, among those that allow offloading the
  // input of s (its fetch beside that step fits, and some step lies between); its time (inf: none).
  constexpr double best_after_offload(int s, int v, int t, long long m, int &k_out) const {
    double found = inf;
    for (int k = 0; k < 3; ++k) {
      // (v, v): the loss's (a fused head's three per chunk), a recompute or keep's two
      const int steps = v < t ? 3 : v == n ? units.links[n].steps : k == 2 ? 1 : 2;
      if (!offload_helps(s, v, steps) || last_peak(units, v, k) + units.links[s].x > m) continue;
      if (at(v, t, m, k).seconds < found) {
        found = at(v, t, m, k).seconds;
        k_out = k;
      }
    }
    return found;
  }

  // What every decision of sub-problem (s, t) needs, whatever the memory left.
  struct Sweeps {
    long long keep_steps[2]{}, held[2]{};
    double keep_time[2]{};
    // per checkpoint until v (index v - s - 1): the forward sweep's peak (offloaded: the input of
    // s dies after the first forward) and time
    std::vector<long long> peak, peak_offloaded;
    std::vector<double> seconds;
    long long own_recompute = 0, own_loss = 0;
  };
  constexpr Sweeps sweeps(const Chain &u, int s, int t) const {
    Sweeps w;
    for (int k = 0; k < 2 && s < n; ++k) {
      w.keep_steps[k] = keep_peak(u, s, t, k);
      w.held[k] = keep_held(u, s, k);
      w.keep_time[k] = L[s].forward_time[k] + L[s].backward_time[k];
    }
    for (int v = s + 1; v <= t; ++v) {
      const long long here = sweep_peak(u, s, t, v - 1);
      w.peak.push_back(std::max(w.peak.empty() ? 0 : w.peak.back(), here));
      w.peak_offloaded.push_back(
          std::max(w.peak_offloaded.empty() ? 0 : w.peak_offloaded.back(), v - 1 > s ? here - units.links[s].x : here));
      w.seconds.push_back((w.seconds.empty() ? 0 : w.seconds.back()) + L[v - 1].forward_time[2]);
    }
    w.own_recompute = s < n ? recompute_peak(u, s, t) : 0;
    w.own_loss = loss_peak(u);
    return w;
  }

  constexpr void fill(int s, int t) {
    const Sweeps w = sweeps(units, s, t);
    for (long long m = 0; m <= M; ++m) {
      Cell pick[3]{};
      auto offer = [&](int k, double seconds, Decision d) {
        if (seconds < pick[k % K].seconds) pick[k % K] = {seconds, d};
      };
      if (s == n) {
        if (w.own_loss <= m) offer(0, L[n].forward_time[0], {Decision::Op::loss});
      } else {
        offer_keeps(s, t, m, w, offer);
        offer_checkpoints(s, t, m, w, offer);
      }
      for (int k = 0; k < K; ++k) {
        at(s, t, m, k) = pick[k];
        best[index(s, t, m)] = std::min(best[index(s, t, m)], pick[k].seconds);
      }
    }
  }
  // recompute (s == t), keep all, keep selective
  template <class Offer>
  constexpr void offer_keeps(int s, int t, long long m, const Sweeps &w, Offer &offer) const {
    if (s == t && L[s].can[2] && w.own_recompute <= m) offer(2, L[s].backward_time[2], {Decision::Op::recompute});
    for (int k = 0; k < 2; ++k) {
      if (!L[s].can[k] || w.keep_steps[k] > m) continue;
      const Decision keep{Decision::Op::keep, Keep(k)};
      if (s == t)
        offer(k, w.keep_time[k], keep);
      else if (m - w.held[k] >= 0)
        offer(k, w.keep_time[k] + best_of(s + 1, t, m - w.held[k]), keep);
    }
  }
  // checkpoint until v, in device memory or offloaded
  template <class Offer>
  constexpr void offer_checkpoints(int s, int t, long long m, const Sweeps &w, Offer &offer) const {
    const bool can_offload = L[s].offload_time >= 0;
    for (int v = s + 1; v <= t; ++v) {
      const int i = v - s - 1;
      if (w.peak[std::size_t(i)] <= m && m - units.links[s].x >= 0) {
        const double later = best_of(v, t, m - units.links[s].x);
        for (int k = 0; k < K; ++k)
          offer(k, w.seconds[std::size_t(i)] + later + at(s, v - 1, m, k).seconds,
                {Decision::Op::checkpoint, Keep::all, v, false});
      }
      if (can_offload && w.peak_offloaded[std::size_t(i)] <= m) {
        int k_later = 0;
        const double later = best_after_offload(s, v, t, m, k_later) + L[s].offload_time;
        for (int k = 0; k < K; ++k)
          offer(k, w.seconds[std::size_t(i)] + later + at(s, v - 1, m, k).seconds,
                {Decision::Op::checkpoint, Keep::all, v, true});
      }
    }
  }

  constexpr void rebuild(Strategy &st, int s, int t, long long m, int k) const {
    const Decision d = at(s, t, m, k).decision;
    st.at(s, t) = d;
    switch (d.op) {
    case Decision::Op::keep:
      if (s < t) {
        const long long rest = m - keep_held(units, s, int(d.keep));
        rebuild(st, s + 1, t, rest, best_class(s + 1, t, rest));
      }
      return;
    case Decision::Op::checkpoint: {
      const int v = d.until;
      if (d.offload) {
        int k_later = 0;
        best_after_offload(s, v, t, m, k_later);
        rebuild(st, v, t, m, k_later);
      } else {
        rebuild(st, v, t, m - units.links[s].x, best_class(v, t, m - units.links[s].x));
      }
      rebuild(st, s, v - 1, m, k);
      return;
    }
    default: return;  // loss, recompute
    }
  }

  std::vector<Link> L;  // the chain (times)
  Chain units;          // the chain in memory units
  int n, M, K;
  std::vector<Cell> cells;   // [(s, t, m), k]
  std::vector<double> best;  // [(s, t, m)]: the least over k
};

}  // namespace remat::detail

export namespace remat {

// The fastest strategy within `budget` bytes that one table finds (detail::FastestTable). Where the
// chain's links can be offloaded (a transfer rate in the costs), a checkpoint may wait in host
// memory: then the sub-problem after it runs without it but for its last step (the fetch).
constexpr BudgetSolution fastest_within_one_table(const Chain &c, long long budget) {
  const long long avail = budget - c.persistent;
  if (avail < 0) return {};
  const int classes = c.offloadable() ? 3 : 1;
  const detail::Quantized q = detail::quantize(c, avail, classes);
  const long long unit = q.unit;
  detail::FastestTable table(c, q, classes);
  table.fill();
  if (!table.feasible()) return {};
  const Strategy st = table.strategy();
  const Outcome o = evaluate(c, st, 0, c.n());
  return {st, true, c.persistent + o.peak, o.seconds, unit};
}

// The fastest strategy whose peak is at most `budget` bytes. Where offloading is an option its
// table has three times the cells and, on a long chain, a coarser memory unit that can miss plans
// a finer one finds: the strategy without offload (a table of its own) is solved too, and the
// faster one kept, so that offering offload never makes a plan slower.
constexpr BudgetSolution fastest_within(const Chain &c, long long budget) {
  BudgetSolution best = fastest_within_one_table(c, budget);
  if (!c.offloadable()) return best;
  Chain on_device = c;
  for (Link &l : on_device.links) l.offload_time = -1;
  BudgetSolution kept = fastest_within_one_table(on_device, budget);
  if (kept.feasible && (!best.feasible || kept.seconds < best.seconds)) best = std::move(kept);
  return best;
}

}  // namespace remat
