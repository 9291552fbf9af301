// Partition remat.planner:memory: the memory model of a strategy on the chain. The live bytes of each
// decision's steps, in one place, and evaluate(): a strategy's exact peak and predicted time.
module;
#include <algorithm>
#include <array>
#include <vector>
export module remat.planner:memory;
import remat.tensors;
import :strategy;
import :costs;

export namespace remat {

// The live bytes of a decision's own steps in sub-problem (s, t), above what its caller holds (the
// input of s and the gradient of t's output are counted): one place for the memory model that
// evaluate, least_memory and fastest_within share.
constexpr long long gradient_after(const Chain &c, int t) { return t < c.n() ? c.links[t + 1].dx : 0; }
// the loss; a fused head's chunks hold forward_temp[0] more at most
constexpr long long loss_peak(const Chain &c) {
  const Link &l = c.links[c.n()];
  return l.x + l.dx + l.forward_temp[0];
}
// ... and its last step's (a fused head's last chunk's backward; the unfused loss has one step,
// whose forward_temp[0] and last_temp are both 0)
constexpr long long loss_last(const Chain &c) {
  const Link &l = c.links[c.n()];
  return l.x + l.dx + l.last_temp;
}
constexpr long long recompute_peak(const Chain &c, int s, int t) {
  const Link &l = c.links[s];
  return l.x + gradient_after(c, t) + l.dx + l.backward_temp[2];
}
// keep (Keep k): its forward's step and its backward's step
constexpr long long keep_peak(const Chain &c, int s, int t, int k) {
  const Link &l = c.links[s];
  const long long next = s < t ? c.links[s + 1].dx : gradient_after(c, t);
  return std::max(l.x + gradient_after(c, t) + l.y + l.saved[k] + l.forward_temp[k],
                  l.x + l.saved[k] + next + l.dx + l.backward_temp[k]);
}
// the last step of a sub-problem whose first unit s ends with backward k (keep all, keep selective,
// recompute) or, for s == n, with the loss: what an offloaded checkpoint's fetch overlaps
constexpr long long last_peak(const Chain &c, int s, int k) {
  if (s == c.n()) return loss_last(c);
  const Link &l = c.links[s];
  return k == 2 ? recompute_peak(c, s, s) : l.x + l.saved[k] + c.links[s + 1].dx + l.dx + l.backward_temp[k];
}
// ... and what stays live beside its sub-problem (s + 1, t)
constexpr long long keep_held(const Chain &c, int s, int k) { return c.links[s].x + c.links[s].saved[k]; }
// checkpoint: forward_discard of unit j (s <= j) in its sweep
constexpr long long sweep_peak(const Chain &c, int s, int t, int j) {
  const Link &l = c.links[j];
  return c.links[s].x + gradient_after(c, t) + (j > s ? l.x : 0) + l.y + l.forward_temp[2];
}

// An offloaded checkpoint (the input of s, copied out beside the forward of s, fetched beside the
// last step of sub-problem (v, t)) saves memory only if some step lies between the two: the
// sweep s..v-1 and (v, t) take at least three steps. `steps_after` counts (v, t)'s, up to 3.
constexpr bool offload_helps(int s, int v, int steps_after) { return (v - s) + steps_after >= 3; }

// The peak (live bytes above the persistent ones) and the seconds of sub-problem (s, t) run by
// `st`, counted as the planner schedules it: a step's new tensors are live with everything live
// before it, and die after it. Also the live bytes of its last step and its steps (up to 3).
struct Outcome {
  long long peak = 0;
  double seconds = 0;
  long long last = 0;
  int steps = 0;
};
constexpr Outcome evaluate(const Chain &c, const Strategy &st, int s, int t) {
  const Link &l = c.links[s];
  const Decision &d = st.at(s, t);
  switch (d.op) {
  case Decision::Op::loss: return {loss_peak(c), l.forward_time[0], loss_last(c), std::min(l.steps, 3)};
  case Decision::Op::recompute: return {recompute_peak(c, s, t), l.backward_time[2], recompute_peak(c, s, t), 1};
  case Decision::Op::keep: {
    const int k = int(d.keep);
    Outcome o{keep_peak(c, s, t, k), l.forward_time[k] + l.backward_time[k], last_peak(c, s, k), 2};
    if (s < t) {
      const Outcome rest = evaluate(c, st, s + 1, t);
      o.peak = std::max(o.peak, keep_held(c, s, k) + rest.peak);
      o.seconds += rest.seconds;
      o.steps = 3;
    }
    return o;
  }
  case Decision::Op::checkpoint: {
    const Outcome later = evaluate(c, st, d.until, t), again = evaluate(c, st, s, d.until - 1);
    const bool offloaded = d.offload && l.x > 0 && offload_helps(s, d.until, later.steps);
    Outcome o{0, 0, again.last, 3};
    for (int j = s; j < d.until; ++j) {
      o.peak = std::max(o.peak, sweep_peak(c, s, t, j) - (offloaded && j > s ? l.x : 0));
      o.seconds += c.links[j].forward_time[2];
    }
    const long long during = offloaded ? std::max(later.peak, later.last + l.x) : l.x + later.peak;
    o.peak = std::max({o.peak, during, again.peak});
    o.seconds += later.seconds + again.seconds + (offloaded ? std::max(l.offload_time, 0.0) : 0);
    return o;
  }
  case Decision::Op::unset: break;
  }
  throw "remat planner: the strategy leaves a sub-problem undecided";
}

}  // namespace remat
