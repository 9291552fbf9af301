// The DSL and the planner: shape inference, policies, and the plan's arena layout checked by an
// independent replay of its schedule.
#include <boost/test/unit_test.hpp>
#include <range/v3/algorithm/any_of.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>
import remat;
import mlp;
import gpt;
import llama;
import gpt_bpe;
import zoo_gated;

#include "policies.h"

using namespace remat;

namespace {

Model small_model() {
  return check(make_model(input(12), linear(12, 16),
                          repeat(5, residual(layer_norm(), linear(16, 32), gelu(), linear(32, 16))), layer_norm(),
                          linear(16, 3), softmax_cross_entropy()))
      .model;
}
// Shapes the examples do not have: a repeat stage first (its blocks pass input gradients to each
// other), two repeat stages around a loose one (segments stay inside a stage), and no repeat
// stage at all (every policy degenerates to none).
Model repeat_first_model() {
  return check(make_model(input(8), repeat(3, residual(layer_norm(), linear(8, 8))), softmax_cross_entropy())).model;
}
Model two_stacks_model() {
  return check(make_model(input(8), repeat(3, residual(linear(8, 8), gelu())), layer_norm(),
                          repeat(4, residual(linear(8, 8))), softmax_cross_entropy()))
      .model;
}
Model flat_model() { return check(make_model(input(8), linear(8, 4), softmax_cross_entropy())).model; }
// An LM head (head_stage: more classes than features) that runs in two chunks at batch 16.
Model lm_head_model() {
  return check(make_model(tokens(50, 64), embedding(50, 8),
                          repeat(3, residual(layer_norm(), linear(8, 16), gelu(), linear(16, 8))), layer_norm(),
                          linear(8, 50), softmax_cross_entropy()))
      .model;
}

const Policy every_2{Policy::Kind::every_n_layers, 2};
// Every policy a model module or the command line can ask for (tests/policies.h); selective
// applies to repeat stages only.
const std::vector<Policy> all_policies = testing::schedule_policies();

std::string str(std::string_view s) { return std::string(s); }
std::string num(std::size_t v) { return std::to_string(v); }
std::string fmt_set(const std::set<std::string> &s) {
  std::string out;
  for (const std::string &x : s) out += x + " ";
  return out;
}

std::string label(const Plan &p) {
  return str(policy_name(p.policy).view()) + " " + str(precision_name(p.precision)) + " batch " +
         std::to_string(p.batch);
}

// Tensors that hold values from outside the schedule (roots and their views).
bool is_persistent(Role r) {
  return r == Role::params || r == Role::grads || r == Role::adam_m || r == Role::adam_v || r == Role::data ||
         r == Role::metrics || r == Role::exchange;
}

enum class PlanPhase { train, optimize, eval };
const std::vector<Step> &steps_of(const Plan &plan, PlanPhase phase) {
  return phase == PlanPhase::train ? plan.train : phase == PlanPhase::optimize ? plan.optimize : plan.eval;
}
std::string phase_name(PlanPhase phase) {
  return phase == PlanPhase::train ? "train" : phase == PlanPhase::optimize ? "optimize" : "eval";
}

// Replays one phase of a schedule and returns its first problem (empty when there is none):
// - liveness: a step allocates only dead roots and frees only live ones, every tensor a kernel
//   binds (read or written) is live, nothing but the persistent tensors is live after the last step;
// - dataflow: every argument a kernel reads is persistent, or was written by an earlier step of
//   the phase (or fetched into by this step or an earlier one) and not freed since;
// - offload: a fetch brings back a tensor copied out earlier, into a live tensor of its size; no
//   kernel binds a fetched tensor before a step awaits its arrival; copy-outs start before the
//   kernel, of tensors written earlier; a tensor freed while its
//   copy-out may still run is awaited (await_out) by the very next step, before anything reuses
//   its memory;
// - layout: live tensors never overlap, and the highest byte they reach is the phase's planned
//   peak (peak_bytes for train and optimize, eval_peak_bytes for eval), exactly for train and eval;
//   in train the activation bytes live at once reach plan.activation_bytes exactly.
std::string check_schedule(const Plan &plan, PlanPhase phase) {
  const std::vector<Step> &steps = steps_of(plan, phase);
  const std::vector<Tensor> &ts = plan.tensors;
  const int n = int(ts.size());
  auto valid = [&](int t) { return 0 <= t && t < n; };
  auto name = [&](int t) { return valid(t) ? str(name_of(ts[t].key).view()) : "tensor #" + std::to_string(t); };
  auto root = [&](int t) { return ts[t].view_of < 0 ? t : ts[t].view_of; };
  auto persistent = [&](int t) { return is_persistent(ts[root(t)].role); };
  std::vector<char> live(n), written(n), in_flight(n), on_host(n), copying_out(n);
  std::vector<int> freed_while_copying;  // by the previous step
  for (int t = 0; t < n; ++t)
    if (ts[t].view_of < 0 && persistent(t)) live[t] = written[t] = 1;
  const std::size_t peak = phase == PlanPhase::eval ? plan.eval_peak_bytes : plan.peak_bytes;
  std::size_t highest = 0, activations_peak = 0;
  for (int i = 0; i < int(steps.size()); ++i) {
    const Step &st = steps[i];
    const std::string at = "step " + std::to_string(i) + " (" + str(variant_name(st.variant)) + " s" +
                           std::to_string(st.stage) + ".b" + std::to_string(st.block) + "): ";
    // Before the kernel: copy-outs awaited, allocations, fetches started, arrivals awaited.
    for (int t : st.await_out) {
      if (!valid(t) || !on_host[t]) return at + "awaits the copy-out of " + name(t) + ", never copied out";
      copying_out[t] = 0;
    }
    for (int t : freed_while_copying)
      if (copying_out[t])
        return at + "may reuse the memory of " + name(t) +
               " while its copy-out runs (freed by the step before, not awaited)";
    freed_while_copying.clear();
    for (int t : st.alloc) {
      if (!valid(t)) return at + "allocates " + name(t);
      if (ts[t].view_of >= 0) return at + "allocates " + name(t) + ", a view";
      if (live[t]) return at + "allocates " + name(t) + ", already live (allocated twice)";
      live[t] = 1;
    }
    for (int t : st.offload) {
      if (!valid(t) || !live[t] || !written[t]) return at + "copies out " + name(t) + ", which holds no value";
      if (persistent(t)) return at + "copies out " + name(t) + ", a persistent tensor";
      on_host[t] = copying_out[t] = 1;
    }
    for (auto [host, into] : st.fetch) {
      if (!valid(host) || !on_host[host]) return at + "fetches the host copy of " + name(host) + ", never copied out";
      if (!valid(into) || !live[into]) return at + "fetches " + name(host) + " into " + name(into) + ", a dead tensor";
      if (ts[into].bytes() != ts[host].bytes()) return at + "fetches " + name(host) + " into a tensor of another size";
      in_flight[into] = written[into] = 1;
    }
    for (int t : st.await_in) {
      if (!valid(t) || !in_flight[t]) return at + "awaits the arrival of " + name(t) + ", which nothing fetches";
      in_flight[t] = 0;
    }
    // The kernel: its reads see the state before it, then its writes land.
    for (const Arg &a : st.args) {
      const std::string arg = "argument " + str(name_of(a.key).view()) + " (" + name(a.tensor) + ")";
      if (!valid(a.tensor)) return at + "binds " + arg;
      const bool reads = a.access == Access::read;
      if (!live[root(a.tensor)]) return at + (reads ? "reads " : "writes ") + arg + ", a dead tensor";
      if (in_flight[a.tensor]) return at + "binds " + arg + " before its fetch arrives";
      if (reads && !persistent(a.tensor) && !written[a.tensor] && !written[root(a.tensor)])
        return at + "reads " + arg + " before it is written";
    }
    for (const Arg &a : st.args)  // a view's rows (a fused head's chunk) count as its root's
      if (a.access == Access::write) written[a.tensor] = written[root(a.tensor)] = 1;
    // The live tensors of this step.
    std::vector<int> now;
    std::size_t activations = 0;
    for (int t = 0; t < n; ++t)
      if (live[t]) {
        now.push_back(t);
        if (is_activation(ts[t].role)) activations += ts[t].bytes();
        const std::size_t end = ts[t].offset + ts[t].bytes();
        if (end > peak) return at + name(t) + " ends at byte " + num(end) + ", past the peak " + num(peak);
        highest = std::max(highest, end);
      }
    activations_peak = std::max(activations_peak, activations);
    for (std::size_t a = 0; a < now.size(); ++a)
      for (std::size_t b = a + 1; b < now.size(); ++b) {
        const Tensor &x = ts[now[a]], &y = ts[now[b]];
        if (!(x.offset + x.bytes() <= y.offset || y.offset + y.bytes() <= x.offset))
          return at + name(now[a]) + " overlaps " + name(now[b]);
      }
    // After the kernel: tensors die.
    for (int t : st.free) {
      if (!valid(t) || !live[t]) return at + "frees " + name(t) + ", already dead (freed while dead)";
      if (persistent(t)) return at + "frees " + name(t) + ", a persistent tensor";
      if (in_flight[t]) return at + "frees " + name(t) + " before its fetch arrives";
      live[t] = written[t] = 0;
      if (copying_out[t]) freed_while_copying.push_back(t);
    }
  }
  for (int t = 0; t < n; ++t) {
    if (live[t] && !persistent(t)) return name(t) + " is still live after the last step (never freed)";
    if (in_flight[t]) return name(t) + " is fetched but its arrival is never awaited";
  }
  if (phase != PlanPhase::optimize && highest != peak)
    return "the live tensors reach byte " + num(highest) + " but the planned peak is " + num(peak);
  if (phase == PlanPhase::train && activations_peak != plan.activation_bytes)
    return "the live activations reach " + num(activations_peak) + " bytes but the plan says " +
           num(plan.activation_bytes);
  return {};
}

// The layout of the tensors themselves: roots start on arena_alignment boundaries; a view lies
// inside its root, has its root's role and starts on an arena_alignment boundary of it; the
// per-layer parameter views tile the flat parameter buffer in order, each starting at the first
// boundary after the one before (padding only for alignment), their elements add up to
// param_count; each gradient sits where its parameter does; the four flat buffers are alike.
std::string check_layout(const Plan &plan) {
  const std::vector<Tensor> &ts = plan.tensors;
  const int n = int(ts.size());
  auto name = [&](int t) { return str(name_of(ts[t].key).view()); };
  auto align_up = [](std::size_t v) { return (v + arena_alignment - 1) / arena_alignment * arena_alignment; };
  std::map<std::string, int> by_name;
  std::vector<int> params;  // per-layer parameter views
  int flat[4] = {-1, -1, -1, -1};
  for (int t = 0; t < n; ++t) {
    const Tensor &x = ts[t];
    if (x.offset % arena_alignment != 0)
      return name(t) + " starts at byte " + num(x.offset) + (x.view_of < 0 ? " of the arena" : " of its root") +
             ", off a " + num(arena_alignment) + "-byte boundary";
    if (x.view_of < 0) {
      for (Role r : {Role::params, Role::grads, Role::adam_m, Role::adam_v})
        if (x.role == r) {
          if (flat[int(r)] >= 0) return "two roots with the role of " + name(t);
          flat[int(r)] = t;
        }
      continue;
    }
    if (x.view_of >= n || ts[x.view_of].view_of >= 0) return name(t) + " is a view of a view or of nothing";
    const Tensor &r = ts[x.view_of];
    if (r.role != x.role) return name(t) + " has another role than its root " + name(x.view_of);
    if (x.offset + x.bytes() > r.bytes()) return name(t) + " runs past the end of " + name(x.view_of);
    if (x.key.stage >= 0) by_name[name(t)] = t;
    if (x.key.stage >= 0 && x.role == Role::params) params.push_back(t);
  }
  for (int r = 0; r < 4; ++r)
    if (flat[r] < 0) return "a flat parameter, gradient or AdamW buffer is missing";
  for (int r = 1; r < 4; ++r)
    if (ts[flat[r]].bytes() != ts[flat[0]].bytes()) return name(flat[r]) + " differs in size from params";
  std::sort(params.begin(), params.end(), [&](int a, int b) { return ts[a].offset < ts[b].offset; });
  std::size_t next = 0;
  long long count = 0;
  for (int p : params) {
    if (ts[p].offset != next)
      return name(p) + " starts at byte " + num(ts[p].offset) + " of params, not at " + num(next) +
             " (the first boundary after the parameter before)";
    next = align_up(ts[p].offset + ts[p].bytes());
    count += (long long)(ts[p].bytes() / 4);
    const std::string g(name_of(key::gradient(ts[p].key)).view());
    const auto it = by_name.find(g);
    if (it == by_name.end() || ts[it->second].role != Role::grads) return name(p) + " has no gradient " + g;
    if (ts[it->second].offset != ts[p].offset || ts[it->second].bytes() != ts[p].bytes())
      return g + " does not sit where " + name(p) + " does";
  }
  if (count != plan.param_count)
    return "the parameter views hold " + std::to_string(count) + " values, param_count is " +
           std::to_string(plan.param_count);
  if (ts[flat[0]].bytes() != next)
    return "params holds " + num(ts[flat[0]].bytes()) + " bytes, its views end at the boundary " + num(next);
  return {};
}

// The layout, then the train, optimize and eval phases; the first problem, named by where it is.
std::string check_plan(const Plan &plan) {
  if (std::string e = check_layout(plan); !e.empty()) return label(plan) + ": layout: " + e;
  for (PlanPhase phase : {PlanPhase::train, PlanPhase::optimize, PlanPhase::eval})
    if (std::string e = check_schedule(plan, phase); !e.empty())
      return label(plan) + ": " + phase_name(phase) + ": " + e;
  return {};
}

}  // namespace
BOOST_AUTO_TEST_CASE(shapes_are_inferred) {
  const Model m = small_model();
  BOOST_TEST(m.n_stages == 3);
  BOOST_TEST(m.stages[1].layers[0].in == 16);  // layer_norm() took the stack's width
  BOOST_TEST(m.stages[1].repeat == 5);
  BOOST_TEST(m.n_blocks() == 5);
  BOOST_TEST(m.loss.classes == 3);
  BOOST_TEST(mlp::model.stages[1].layers[2].out == mlp::hidden);
}

BOOST_AUTO_TEST_CASE(mistakes_are_named) {
  auto error = [](Model m) { return std::string(check(m).error.view()); };
  BOOST_TEST(error(make_model(input(8), linear(8, 4), linear(5, 2), softmax_cross_entropy())) ==
             "remat: stage 0 layer 1 (linear): expects 5 input features but the stack carries 4");
  BOOST_TEST(error(make_model(input(8), linear(8, 4), softmax_cross_entropy(3))) ==
             "remat: softmax_cross_entropy(3) follows a stack of width 4");
  BOOST_TEST(error(make_model(input(8), repeat(0, residual(linear(8, 8))), softmax_cross_entropy())) ==
             "remat: stage 0: repeat(n, ...) needs n >= 1, got 0");
  BOOST_TEST(error(make_model(linear(8, 4))) == "remat: the model needs input(width) or tokens(vocab, block_size)");
}

BOOST_AUTO_TEST_CASE(more_mistakes_are_named) {
  auto error = [](Model m) { return std::string(check(m).error.view()); };
  Block widening;
  widening.push(linear(4, 8));
  BOOST_TEST(error(make_model(input(4), repeat(3, widening), softmax_cross_entropy())) ==
             "remat: stage 0: repeat(3, ...) needs a block that keeps its width, but it maps 4 features to 8");
  BOOST_TEST(error(make_model(tokens(16, 4), embedding(16, 6), linear(6, 18), causal_self_attention(2),
                              softmax_cross_entropy())) ==
             "remat: stage 0 layer 2 (causal_self_attention): cannot end a block (its backward reads its output)");
  BOOST_TEST(error(make_model(tokens(16, 0), embedding(16, 6), softmax_cross_entropy())) ==
             "remat: tokens(vocab, block_size) needs vocab >= 1 and block_size >= 1");
  BOOST_TEST(error(make_model(input(4), linear(4, 9), causal_self_attention(3), softmax_cross_entropy())) ==
             "remat: stage 0 layer 1 (causal_self_attention): attention needs sequences: tokens(vocab, block_size)");
}

// Plans for the unusual shapes (repeat_first_model and the others above).
BOOST_AUTO_TEST_CASE(unusual_stacks_plan_consistently) {
  const Model repeat_first = repeat_first_model(), two_stacks = two_stacks_model(), flat = flat_model();
  for (const Model &m : {repeat_first, two_stacks, flat})
    for (Policy p : all_policies) {
      const Plan plan = make_plan(m, p, 8);
      const std::string problem = check_plan(plan);
      BOOST_TEST(problem.empty(), problem);
      // every backward but the model's very first block writes the gradient of its input
      int with_dx = 0, backwards = 0;
      for (const Step &st : plan.train)
        if (st.variant == Variant::backward_saved || st.variant == Variant::backward_selective ||
            st.variant == Variant::backward_recompute) {
          ++backwards;
          for (const Arg &a : st.args) with_dx += a.key.slot == Slot::input_grad && a.access == Access::write;
        }
      BOOST_TEST(with_dx == backwards - (m.stages[0].repeat > 1 ? 0 : 1), policy_name(p).view());
    }
  BOOST_TEST(make_plan(flat, sqrt_n, 8).recompute_launches == 0);
  BOOST_TEST(make_plan(flat, selective, 8).recompute_launches == 0);  // no repeat stage: selective is none
  // sqrt_n over 3 + 4 blocks: ceil(sqrt(3)) = 2 parts (2 + 1 blocks) and ceil(sqrt(4)) = 2 (2 + 2),
  // none crossing; the last part of each keeps its internals
  BOOST_TEST(make_plan(two_stacks, sqrt_n, 8).recompute_launches == 2 + 2);
}

BOOST_AUTO_TEST_CASE(policies_choose_segments) {
  auto firsts = [](Policy p, int n) {
    std::vector<int> out;
    for (Segment s : segments(p, n)) out.push_back(s.first);
    return out;
  };
  BOOST_TEST(segments(none, 16).empty());
  BOOST_TEST(segments(selective, 16).empty());  // selective recomputes inside each block's backward
  BOOST_TEST(firsts(full, 4) == (std::vector<int>{0, 1, 2, 3}));
  BOOST_TEST(firsts(Policy{Policy::Kind::every_n_layers, 3}, 10) == (std::vector<int>{0, 3, 6, 9}));
  // sqrt_n: ceil(sqrt(L)) parts, every one but the last a segment (as checkpoint_sequential)
  const auto sq = segments(sqrt_n, 16);  // ceil(sqrt(16)) = 4 parts of 4 blocks
  BOOST_TEST(sq.size() == 3u);
  BOOST_TEST(sq[1].first == 4);
  BOOST_TEST(sq[1].last == 7);
  BOOST_TEST(sq[2].last == 11);
  BOOST_TEST(segments(sqrt_n, 10).size() == 3u);     // ceil(sqrt(10)) = 4 parts, 3+3+3+1
  BOOST_TEST(segments(sqrt_n, 6).back().last == 3);  // the GPT: 2+2 recomputed, 2 kept
  BOOST_TEST(segments(sqrt_n, 1).empty());
}

// Every (model, policy, precision, GEMM placement, batch) combination replays cleanly in train,
// optimize and eval (check_plan); batch 7 gives row counts off every alignment.
BOOST_AUTO_TEST_CASE(every_schedule_replays_cleanly) {
  const std::vector<std::pair<std::string, Model>> models = {
      {"small", small_model()}, {"repeat_first", repeat_first_model()}, {"two_stacks", two_stacks_model()},
      {"flat", flat_model()},   {"lm_head", lm_head_model()},           {"mlp", mlp::model},
      {"gpt", gpt::model}};
  int replayed = 0;
  for (const auto &[model_name, m] : models)
    for (Policy p : all_policies)
      for (Precision precision : {Precision::fp32, Precision::bf16})
        for (int batch : {1, 7, 256}) {
          const Plan plan = make_plan(m, p, batch, precision);
          BOOST_TEST((plan.policy == p && plan.precision == precision && plan.batch == batch));
          const std::string problem = check_plan(plan);
          BOOST_TEST(problem.empty(), model_name << " " << problem);
          BOOST_TEST(plan.eval_peak_bytes <= plan.peak_bytes, model_name << " " << label(plan));
          ++replayed;
        }
  BOOST_TEST(replayed == 7 * 9 * 2 * 3);
}

// The replay finds what it is meant to find: each corruption of a copy of a real plan is reported
// with the problem it introduces.
BOOST_AUTO_TEST_CASE(replay_reports_corrupted_plans) {
  const Plan good = make_plan(mlp::model, full, 8);
  BOOST_TEST_REQUIRE(check_plan(good).empty(), check_plan(good));
  auto expect = [](const Plan &bad, const std::string &what, std::string_view corruption) {
    const std::string problem = check_plan(bad);
    BOOST_TEST(problem.find(what) != std::string::npos,
               corruption << ": expected \"" << what << "\", got \"" << problem << "\"");
  };
  auto step_of = [](const std::vector<Step> &steps, Variant v, int stage, int block) {
    for (int i = 0; i < int(steps.size()); ++i)
      if (steps[i].variant == v && steps[i].stage == stage && steps[i].block == block) return i;
    BOOST_TEST_REQUIRE(false, "no step " << variant_name(v) << " s" << stage << ".b" << block);
    return -1;
  };
  auto arg_of = [](const Step &st, Slot slot, Access access) {
    for (int k = 0; k < int(st.args.size()); ++k)
      if (st.args[k].key.slot == slot && st.args[k].access == access) return k;
    BOOST_TEST_REQUIRE(false, "no argument " << int(slot));
    return -1;
  };
  auto tensor = [](const Plan &plan, const TensorKey &k) {
    const TensorId t = plan.find(k);
    BOOST_TEST_REQUIRE(t.valid(), "no tensor " << name_of(k).view());
    return t.index;
  };
  const Block &blocks = mlp::model.stages[1];
  auto y = [](int b) { return key::block_output().at(1, b); };  // s1.b<b>.y
  auto dx = [](int b) { return key::input_grad().at(1, b); };   // s1.b<b>.dx
  // MLP under full: train = stem forward, s1.b0..15 forward_discard, head forward, loss, head
  // backward, s1.b15..0 backward_recompute, stem backward.
  const int fwd3 = step_of(good.train, Variant::forward_discard, 1, 3);
  const int bwd15 = step_of(good.train, Variant::backward_recompute, 1, 15);
  const int bwd14 = step_of(good.train, Variant::backward_recompute, 1, 14);
  {  // a kernel reads a live tensor that nothing has written yet: its own output
    Plan bad = good;
    Step &st = bad.train[fwd3];
    st.args[arg_of(st, Slot::block_input, Access::read)].tensor =
        st.args[arg_of(st, Slot::block_output, Access::write)].tensor;
    expect(bad, "reads argument x (s1.b3.y) before it is written", "x bound to y");
  }
  {  // a read bound to a tensor only written later
    Plan bad = good;
    Step &st = bad.train[bwd15];
    st.args[arg_of(st, Slot::output_grad, Access::read)].tensor = tensor(bad, dx(14));
    expect(bad, "reads argument dy (s1.b14.dx), a dead tensor", "dy bound to a later dx");
  }
  {  // a forward step dropped: the next forward reads an input that never came to life
    Plan bad = good;
    bad.train.erase(bad.train.begin() + fwd3);
    expect(bad, "reads argument x (s1.b3.y), a dead tensor", "forward of s1.b3 dropped");
  }
  {  // a backward that no longer writes dx: the next backward reads it unwritten
    Plan bad = good;
    Step &st = bad.train[bwd15];
    st.args.erase(st.args.begin() + arg_of(st, Slot::input_grad, Access::write));
    expect(bad,
           "step " + std::to_string(bwd14) +
               " (backward_recompute s1.b14): reads argument dy (s1.b15.dx) before it is written",
           "dx not written");
  }
  {  // a checkpoint freed right after the forward that reads it, not after its backward
    Plan bad = good;
    const int x = tensor(bad, y(0)), fwd1 = step_of(bad.train, Variant::forward_discard, 1, 1);
    for (Step &st : bad.train) std::erase(st.free, x);
    bad.train[fwd1].free.push_back(x);
    expect(bad, "reads argument x (s1.b0.y), a dead tensor", "checkpoint freed early");
  }
  {  // a tensor never freed: the input gradient the last step (the stem's backward) reads
    Plan bad = good;
    std::erase(bad.train.back().free, tensor(bad, dx(0)));
    expect(bad, "s1.b0.dx is still live after the last step", "dx leaked");
  }
  {  // a tensor allocated while live
    Plan bad = good;
    bad.train[fwd3 + 1].alloc.push_back(tensor(bad, y(2)));
    expect(bad, "allocates s1.b2.y, already live", "allocated twice");
  }
  {  // two live tensors at one offset
    Plan bad = good;
    bad.tensors[tensor(bad, y(0))].offset = bad.tensors[tensor(bad, y(1))].offset;
    expect(bad, "overlaps", "overlap");
  }
  {  // the planned numbers must be the replay's
    Plan low = good, high = good, act = good, eval = good;
    low.peak_bytes -= arena_alignment;
    expect(low, "past the peak", "peak too low");
    high.peak_bytes += arena_alignment;
    expect(high, "but the planned peak is " + num(high.peak_bytes), "peak too high");
    act.activation_bytes += 4;
    expect(act, "the live activations reach " + num(good.activation_bytes), "activation bytes");
    eval.eval_peak_bytes += arena_alignment;
    expect(eval, "eval: the live tensors reach", "eval peak");
  }
  {  // optimize: AdamW's moment update bound to an activation, dead in that phase
    Plan bad = good;
    Step &st = bad.optimize[0];
    st.args[arg_of(st, Slot::adamw_m, Access::write)].tensor = tensor(bad, y(0));
    expect(bad, "optimize: step 0 (adamw s-1.b0): writes argument m (s1.b0.y), a dead tensor", "adamw's m");
  }
  {  // eval: its first forward dropped
    Plan bad = good;
    bad.eval.erase(bad.eval.begin());
    expect(bad, "eval: step 0 (forward_discard s1.b0): reads argument x (eval.s0.b0.y), a dead tensor",
           "eval forward dropped");
  }
  {  // layout: a parameter off its place, off alignment, or apart from its gradient
    Plan moved = good, unaligned = good, apart = good;
    moved.tensors[tensor(moved, key::parameter(blocks, 2, 0).at(1, 3))].offset += arena_alignment;
    expect(moved, "layout: s1.b3.p2_w starts at byte", "parameter moved");
    unaligned.tensors[tensor(unaligned, key::parameter(blocks, 2, 1).at(1, 3))].offset += 4;
    expect(unaligned, "layout: s1.b3.p2_b starts at byte", "parameter unaligned");
    std::swap(apart.tensors[tensor(apart, key::gradient(key::parameter(blocks, 2, 1)).at(1, 3))].offset,
              apart.tensors[tensor(apart, key::gradient(key::parameter(blocks, 4, 1)).at(1, 3))].offset);
    expect(apart, "does not sit where", "gradient apart from its parameter");
  }

  // Offload (GPT under sqrt_n + offload): the transfers must be in place.
  const Plan off = make_plan(gpt::model, with_offload(sqrt_n), 4);
  BOOST_TEST_REQUIRE(check_plan(off).empty(), check_plan(off));
  int fetching = -1, awaiting_out = -1;
  for (int i = 0; i < int(off.train.size()); ++i) {
    if (fetching < 0 && !off.train[i].fetch.empty()) fetching = i;
    if (awaiting_out < 0 && !off.train[i].await_out.empty()) awaiting_out = i;
  }
  BOOST_TEST_REQUIRE(fetching >= 0);
  BOOST_TEST_REQUIRE(awaiting_out >= 0);
  const auto [host, restored] = off.train[fetching].fetch[0];
  BOOST_TEST_REQUIRE(ranges::any_of(off.train[fetching + 1].await_in, [&](int t) { return t == restored; }));
  {  // no fetch, no wait: the restored copy is read with nothing in it
    Plan bad = off;
    bad.train[fetching].fetch.erase(bad.train[fetching].fetch.begin());
    std::erase(bad.train[fetching + 1].await_in, restored);
    expect(bad, "(" + str(name_of(off.tensors[restored].key).view()) + ") before it is written", "fetch dropped");
  }
  {  // the fetch but no wait for it
    Plan bad = off;
    std::erase(bad.train[fetching + 1].await_in, restored);
    expect(bad, "before its fetch arrives", "await_in dropped");
  }
  {  // a wait for a fetch never started
    Plan bad = off;
    bad.train[fetching].fetch.erase(bad.train[fetching].fetch.begin());
    expect(bad, "awaits the arrival of " + str(name_of(off.tensors[restored].key).view()) + ", which nothing fetches",
           "fetch dropped, await_in kept");
  }
  {  // memory reused while its copy-out may run
    Plan bad = off;
    bad.train[awaiting_out].await_out.clear();
    expect(bad, "while its copy-out runs", "await_out dropped");
  }
  {  // a host copy that is never made
    Plan bad = off;
    for (Step &st : bad.train) std::erase(st.offload, host);
    expect(bad, "never copied out", "offload dropped");
  }
}

// Activation bytes against a hand count for the MLP (fp32, B rows, C = width, H = hidden):
//   none: 17 block inputs (16 blocks + head) of B*C, per block the internals LayerNorm output
//         (C), linear output (H), GELU output (H) and two row statistics, the head's LayerNorm
//         output and statistics, and the logits (10):   4B (17C + 16 (C + 2H + 2) + C + 2 + 10)
//   full: the 16 block inputs and the head input, the head's LayerNorm output (C: a GEMM operand,
//         so a buffer), plus one block's recomputed internals (LayerNorm output C, linear output
//         H, GELU output H, two statistics):             4B (19C + 2H + 2)
//   selective: per block its input, its LayerNorm output (C), the first linear's output (H)
//         and the two statistics, the head's input and LayerNorm output; the peak is the last
//         block's backward, which rebuilds its GELU output (H):
//         4B (16 (2C + H + 2) + 2C + H) = 4B (34C + 17H + 32)
BOOST_AUTO_TEST_CASE(activation_bytes_match_the_hand_count) {
  const long B = 256, C = mlp::width, H = mlp::hidden;
  const Plan p_none = make_plan(mlp::model, none, B), p_full = make_plan(mlp::model, full, B);
  BOOST_TEST(p_none.activation_bytes == std::size_t(4 * B * (17 * C + 16 * (C + 2 * H + 2) + C + 2 + 10)));
  BOOST_TEST(p_full.activation_bytes == std::size_t(4 * B * (19 * C + 2 * H + 2)));
  BOOST_TEST(p_full.activation_bytes <= p_none.activation_bytes / 4);
  BOOST_TEST(make_plan(mlp::model, selective, B).activation_bytes == std::size_t(4 * B * (34 * C + 17 * H + 32)));
  const Plan p_sqrt = make_plan(mlp::model, sqrt_n, B), p_two = make_plan(mlp::model, every_2, B);
  BOOST_TEST(p_sqrt.activation_bytes < p_two.activation_bytes);
  BOOST_TEST(p_two.activation_bytes < p_none.activation_bytes);
}

BOOST_AUTO_TEST_CASE(recompute_launches_per_policy) {
  auto launches = [](Policy p) { return make_plan(mlp::model, p, 64).recompute_launches; };
  BOOST_TEST(launches(none) == 0);
  BOOST_TEST(launches(full) == 16);       // one fused recompute-backward per block
  BOOST_TEST(launches(every_2) == 8);     // blocks 0, 2, ..., 14
  BOOST_TEST(launches(sqrt_n) == 12);     // per segment of 4 (3 of them): 3 forward replays + 1 fused backward
  BOOST_TEST(launches(selective) == 16);  // every block's backward rebuilds its GELU output
  // Recompute kernels appear only under policies that checkpoint.
  for (Policy p : {none, selective}) {
    const Plan plan = make_plan(mlp::model, p, 64);
    BOOST_TEST(!ranges::any_of(plan.train, [](const Step &s) { return s.variant == Variant::backward_recompute; }),
               policy_name(p).view());
  }
}

namespace {

// A plan frozen at compile time: one constant evaluation of make_plan per table, copied into
// arrays (a constexpr Plan cannot outlive its evaluation: it owns vectors).
struct TensorRow {
  TensorKey key;
  Role role;
  int view_of;
  std::size_t offset, bytes;
};
struct ArgRow {  // the arguments of every train step, in order
  int step;
  TensorKey key;
  int tensor;
  Access access;
};
struct Numbers {
  std::size_t tensors, train_args, train_steps, peak_bytes, activation_bytes, eval_peak_bytes, offload_bytes,
      flat_bytes;  // the params, grads, adam_m and adam_v buffers
  long long param_count;
  int recompute_launches, total_launches;
};

template <const Model &M, Policy P, int Batch>
struct Frozen {
  static constexpr Numbers numbers = [] {
    const Plan p = make_plan(M, P, Batch);
    Numbers n{p.tensors.size(), 0, p.train.size(), p.peak_bytes,         p.activation_bytes, p.eval_peak_bytes,
              p.offload_bytes,  0, p.param_count,  p.recompute_launches, p.total_launches};
    for (const Step &st : p.train) n.train_args += st.args.size();
    for (const Tensor &t : p.tensors)
      if (t.view_of < 0 &&
          (t.role == Role::params || t.role == Role::grads || t.role == Role::adam_m || t.role == Role::adam_v))
        n.flat_bytes += t.bytes();
    return n;
  }();
  static constexpr std::array<TensorRow, numbers.tensors> tensors = [] {
    const Plan p = make_plan(M, P, Batch);
    std::array<TensorRow, numbers.tensors> rows{};
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Tensor &t = p.tensors[i];
      rows[i] = {t.key, t.role, t.view_of, t.offset, t.bytes()};
    }
    return rows;
  }();
  static constexpr std::array<ArgRow, numbers.train_args> train_args = [] {
    const Plan p = make_plan(M, P, Batch);
    std::array<ArgRow, numbers.train_args> rows{};
    std::size_t k = 0;
    for (int i = 0; i < int(p.train.size()); ++i)
      for (const Arg &a : p.train[i].args) rows[k++] = {i, a.key, a.tensor, a.access};
    return rows;
  }();
};

using FrozenMlp = Frozen<mlp::model, full, 32>;
using FrozenGpt = Frozen<gpt::model, selective, 8>;

// The hand counts of activation_bytes_match_the_hand_count and
// gpt_activation_bytes_match_the_hand_count, checked by the compiler.
namespace mlp_count {
constexpr long long B = 32, C = mlp::width, H = mlp::hidden, K = mlp::classes;
// stem linear; per block LayerNorm (2C), linear C -> H, linear H -> C; head LayerNorm, linear
constexpr long long params =
    mlp::image_pixels * C + C + mlp::blocks * (2 * C + C * H + H + H * C + C) + 2 * C + C * K + K;
static_assert(FrozenMlp::numbers.activation_bytes == std::size_t(4 * B * (19 * C + 2 * H + 2)));
static_assert(FrozenMlp::numbers.param_count == params);
// Every parameter is a multiple of 16 floats but the head's bias (10 floats), the last of the
// undecayed range: each of the four flat buffers carries 6 floats of alignment padding.
static_assert(FrozenMlp::numbers.flat_bytes == 4 * 4 * std::size_t(params + 6));
static_assert(FrozenMlp::numbers.peak_bytes >= FrozenMlp::numbers.activation_bytes + FrozenMlp::numbers.flat_bytes);
static_assert(FrozenMlp::numbers.eval_peak_bytes <= FrozenMlp::numbers.peak_bytes);
static_assert(FrozenMlp::numbers.peak_bytes % arena_alignment == 0);
static_assert(FrozenMlp::numbers.recompute_launches == mlp::blocks);
}  // namespace mlp_count

namespace gpt_count {
constexpr long long B = 8, R = B * gpt::block_size, C = gpt::n_embd, H = gpt::n_head, L = gpt::n_layer, V = gpt::vocab;
// token and position tables; per block two LayerNorms, q/k/v, projection, MLP up and down; head
constexpr long long params = V * C + gpt::block_size * C +
                             L * (4 * C + C * 3 * C + 3 * C + C * C + C + C * 4 * C + 4 * C + 4 * C * C + C) + 2 * C +
                             C * V + V;
static_assert(FrozenGpt::numbers.activation_bytes == std::size_t(4 * R * (L * (11 * C + H + 4) + 8 * C)));
static_assert(FrozenGpt::numbers.param_count == params);
static_assert(FrozenGpt::numbers.flat_bytes == 4 * 4 * std::size_t(params));  // every size a multiple of 16 floats
static_assert(FrozenGpt::numbers.peak_bytes >= FrozenGpt::numbers.activation_bytes + FrozenGpt::numbers.flat_bytes);
static_assert(FrozenGpt::numbers.eval_peak_bytes <= FrozenGpt::numbers.peak_bytes);
}  // namespace gpt_count

// Known at compile time, at each example's default batch: selective saves less than none and full
// less than selective (the GPT, Llama); the MLP's own policy saves less than a quarter of none's.
namespace example_plans {
template <const Model &M, int Batch>
constexpr std::size_t activations(const Policy &p) {
  return make_plan(M, p, Batch).activation_bytes;
}
static_assert(activations<gpt::model, gpt::default_batch>(selective) <
              activations<gpt::model, gpt::default_batch>(none));
static_assert(activations<gpt::model, gpt::default_batch>(full) <
              activations<gpt::model, gpt::default_batch>(selective));
static_assert(activations<llama::model, llama::default_batch>(selective) <
              activations<llama::model, llama::default_batch>(none));
static_assert(activations<llama::model, llama::default_batch>(full) <
              activations<llama::model, llama::default_batch>(selective));
static_assert(activations<mlp::model, mlp::default_batch>(mlp::policy) <
              activations<mlp::model, mlp::default_batch>(none) / 4);
}  // namespace example_plans

// The frozen plan against the run-time planner's plan for the same inputs, element by element.
template <class F>
void compare_with_frozen(const Plan &plan) {
  const Numbers &n = F::numbers;
  BOOST_TEST(plan.peak_bytes == n.peak_bytes);
  BOOST_TEST(plan.activation_bytes == n.activation_bytes);
  BOOST_TEST(plan.eval_peak_bytes == n.eval_peak_bytes);
  BOOST_TEST(plan.offload_bytes == n.offload_bytes);
  BOOST_TEST(plan.param_count == n.param_count);
  BOOST_TEST(plan.recompute_launches == n.recompute_launches);
  BOOST_TEST(plan.total_launches == n.total_launches);
  BOOST_TEST_REQUIRE(plan.tensors.size() == F::tensors.size());
  for (std::size_t i = 0; i < F::tensors.size(); ++i) {
    const Tensor &t = plan.tensors[i];
    const TensorRow &c = F::tensors[i];
    BOOST_TEST(name_of(t.key).view() == name_of(c.key).view());
    BOOST_TEST((t.role == c.role), name_of(t.key).view());
    BOOST_TEST(t.view_of == c.view_of, name_of(t.key).view());
    BOOST_TEST(t.offset == c.offset, name_of(t.key).view());
    BOOST_TEST(t.bytes() == c.bytes, name_of(t.key).view());
  }
  BOOST_TEST_REQUIRE(plan.train.size() == n.train_steps);
  std::size_t k = 0;
  for (int i = 0; i < int(plan.train.size()); ++i)
    for (const Arg &a : plan.train[i].args) {
      BOOST_TEST_REQUIRE(k < F::train_args.size());
      const ArgRow &c = F::train_args[k++];
      BOOST_TEST(c.step == i);
      BOOST_TEST(name_of(a.key).view() == name_of(c.key).view(), "step " << i);
      BOOST_TEST(a.tensor == c.tensor, "step " << i << " " << name_of(a.key).view());
      BOOST_TEST((a.access == c.access), "step " << i << " " << name_of(a.key).view());
    }
  BOOST_TEST(k == F::train_args.size());
  const std::string problem = check_plan(plan);
  BOOST_TEST(problem.empty(), problem);
}

}  // namespace

// The plan a model module computes at compile time (static_asserts above: the hand counts and
// the layout's bounds) is the plan the run-time planner computes for a batch it reads at run time.
BOOST_AUTO_TEST_CASE(plan_is_known_at_compile_time) {
  static volatile int mlp_batch = 32, gpt_batch = 8;  // not constant expressions
  const int b_mlp = mlp_batch, b_gpt = gpt_batch;
  compare_with_frozen<FrozenMlp>(make_plan(mlp::model, full, b_mlp));
  compare_with_frozen<FrozenGpt>(make_plan(gpt::model, selective, b_gpt));
  // the batch does reach the plan: another one gives other numbers
  BOOST_TEST(make_plan(mlp::model, full, b_mlp + 1).activation_bytes != FrozenMlp::numbers.activation_bytes);
}
// GPT activation bytes against a hand count, per Korthikanti et al. 2022 adapted to fp32 and to
// this layout. Per token and transformer block, Korthikanti counts 34 C bytes in fp16 (2 bytes
// per value for the LayerNorm input and output, q/k/v, attention output, the residual sum, the
// second LayerNorm's input and output, the 4C MLP hidden values before and after GELU: 16 C
// values, plus 2 C one-byte dropout masks) and 5 H T bytes for the T x T attention matrices.
// remat keeps 16 C values in fp32 (64 C bytes), no masks (they are recomputed from counters) and
// no attention matrix: only the per-head log-sum-exp (H values) and four LayerNorm statistics.
// With R = B T rows, L = 6 blocks, V the vocabulary:
//   none:      4R (L (16C + H + 4) + C + (C + 2) + V)    (+ head input, its LayerNorm, logits)
//   selective: 4R (L (11C + H + 4) + 8C)  each block keeps x, its two LayerNorm outputs (2C: GEMM
//              operands, so buffers), qkv (3C), the residual sum (C), the 4C MLP hidden; the
//              head's LayerNorm output (C); the peak adds the last block's rebuilt attention
//              output (C) and GELU output (4C) during its backward
//   full:      4R (L C + 18C + H + 4)     one input per block, the head's LayerNorm output, plus
//              one block's internals (its LayerNorm outputs included)
BOOST_AUTO_TEST_CASE(gpt_activation_bytes_match_the_hand_count) {
  const long B = 8, T = gpt::block_size, R = B * T, C = gpt::n_embd, H = gpt::n_head, V = gpt::vocab, L = gpt::n_layer;
  auto bytes = [&](Policy p) { return make_plan(gpt::model, p, B).activation_bytes; };
  BOOST_TEST(bytes(none) == std::size_t(4 * R * (L * (16 * C + H + 4) + C + (C + 2) + V)));
  BOOST_TEST(bytes(selective) == std::size_t(4 * R * (L * (11 * C + H + 4) + 8 * C)));
  BOOST_TEST(bytes(full) == std::size_t(4 * R * (L * C + 18 * C + H + 4)));
}

// bf16: the same counts with activations at 2 bytes; the statistics (H attention log-sum-exps
// and 4 LayerNorm statistics per block, 2 for the head's LayerNorm) stay 4 bytes.
BOOST_AUTO_TEST_CASE(gpt_bf16_activation_bytes_match_the_hand_count) {
  const long B = 8, T = gpt::block_size, R = B * T, C = gpt::n_embd, H = gpt::n_head, V = gpt::vocab, L = gpt::n_layer;
  auto bytes = [&](Policy p) { return make_plan(gpt::model, p, B, Precision::bf16).activation_bytes; };
  BOOST_TEST(bytes(none) == std::size_t(2 * R * (L * 16 * C + C + C + V) + 4 * R * (L * (H + 4) + 2)));
  BOOST_TEST(bytes(selective) == std::size_t(2 * R * (L * 11 * C + 8 * C) + 4 * R * L * (H + 4)));
  BOOST_TEST(bytes(full) == std::size_t(2 * R * (L * C + 18 * C) + 4 * R * (H + 4)));
}

// A bf16 plan runs the same steps on the same tensors as the fp32 plan, plus a bf16 copy of each
// linear's weight and bias as kernel workspace; only activation elements shrink. Parameters, their
// gradients, the AdamW moments and statistics stay fp32. (Both replay cleanly:
// every_schedule_replays_cleanly.)
BOOST_AUTO_TEST_CASE(bf16_plans_differ_only_in_activation_sizes) {
  for (Policy p : all_policies) {
    const Plan fp32 = make_plan(gpt::model, p, 4), bf16 = make_plan(gpt::model, p, 4, Precision::bf16);
    BOOST_TEST((bf16.precision == Precision::bf16));
    std::vector<Tensor> same;
    std::vector<int> to_fp32;  // bf16 tensor -> the fp32 plan's tensor; -1 for the parameter copies
    for (const Tensor &t : bf16.tensors) {
      if (t.key.slot != Slot::weight_copy) {  // not p<k>_w16 or p<k>_b16
        to_fp32.push_back(int(same.size()));
        same.push_back(t);
        continue;
      }
      to_fp32.push_back(-1);
      BOOST_TEST((t.role == Role::scratch && t.elem_bytes == 2 && t.dims == (t.key.index == 0 ? 2 : 1)),
                 name_of(t.key).view());
    }
    BOOST_TEST_REQUIRE(fp32.tensors.size() == same.size());
    BOOST_TEST(bf16.peak_bytes < fp32.peak_bytes);
    BOOST_TEST(bf16.offload_bytes * 2 == fp32.offload_bytes);
    for (std::size_t i = 0; i < fp32.tensors.size(); ++i) {
      const Tensor &a = fp32.tensors[i], &b = same[i];
      BOOST_TEST(name_of(a.key).view() == name_of(b.key).view());
      BOOST_TEST((a.role == b.role), name_of(a.key).view());
      BOOST_TEST(a.view_of == (b.view_of < 0 ? -1 : to_fp32[b.view_of]), name_of(a.key).view());
      const bool statistic = a.kind == LocalTensor::Kind::statistic;  // statistics, row sums, dp<k>
      const bool fp32_always = a.role == Role::params || a.role == Role::grads || a.role == Role::adam_m ||
                               a.role == Role::adam_v || a.role == Role::metrics || a.key.slot == Slot::labels ||
                               a.key.slot == Slot::inputs || statistic;
      BOOST_TEST(a.elem_bytes == 4);
      BOOST_TEST(b.elem_bytes == (fp32_always ? 4 : 2), name_of(a.key).view());
    }
    // The same steps: each binds the same tensors the same way, the weight copies aside.
    auto ids = [&](const std::vector<int> &list, bool map) {
      std::string out;
      for (int t : list)
        if (!map || to_fp32[t] >= 0) out += std::to_string(map ? to_fp32[t] : t) + " ";
      return out;
    };
    auto args = [&](const std::vector<Arg> &list, bool map) {
      std::string out;
      for (const Arg &a : list)
        if (!map || to_fp32[a.tensor] >= 0)
          out += str(name_of(a.key).view()) + (a.access == Access::read ? "<" : ">") +
                 std::to_string(map ? to_fp32[a.tensor] : a.tensor) + " ";
      return out;
    };
    auto pairs = [&](const std::vector<std::pair<int, int>> &list, bool map) {
      std::vector<int> flat;
      for (auto [a, b] : list) flat.insert(flat.end(), {a, b});
      return ids(flat, map);
    };
    for (PlanPhase phase : {PlanPhase::train, PlanPhase::optimize, PlanPhase::eval}) {
      const std::vector<Step> &s32 = steps_of(fp32, phase), &s16 = steps_of(bf16, phase);
      BOOST_TEST_REQUIRE(s32.size() == s16.size(), phase_name(phase));
      for (std::size_t i = 0; i < s32.size(); ++i) {
        const Step &a = s32[i], &b = s16[i];
        const std::string where = phase_name(phase) + " step " + std::to_string(i) + " " + str(policy_name(p).view());
        BOOST_TEST((a.variant == b.variant && a.stage == b.stage && a.block == b.block && a.rng_block == b.rng_block &&
                    a.recompute == b.recompute && a.weight_decay == b.weight_decay),
                   where);
        BOOST_TEST(args(a.args, false) == args(b.args, true), where);
        BOOST_TEST(ids(a.alloc, false) == ids(b.alloc, true), where);
        BOOST_TEST(ids(a.free, false) == ids(b.free, true), where);
        BOOST_TEST(ids(a.offload, false) == ids(b.offload, true), where);
        BOOST_TEST(ids(a.await_out, false) == ids(b.await_out, true), where);
        BOOST_TEST(ids(a.await_in, false) == ids(b.await_in, true), where);
        BOOST_TEST(pairs(a.fetch, false) == pairs(b.fetch, true), where);
      }
    }
  }
  BOOST_TEST(name_of("gpt", kernel_key(1, Variant::backward_recompute, Precision::bf16)).view() ==
             "gpt_s1_backward_recompute_bf16");
  BOOST_TEST(name_of("gpt", kernel_key(0, Variant::adamw, Precision::bf16)).view() == "gpt_adamw");
}

// Plans of library GEMMs: every linear input and output is a buffer, a bf16 copy of each
// linear's weight in bf16 plans; their schedules replay cleanly and keep fewer activations under
// recompute.
BOOST_AUTO_TEST_CASE(library_gemm_plans_replay_without_overlap) {
  for (Precision precision : {Precision::fp32, Precision::bf16})
    for (Policy p : all_policies) {
      for (const Model *m : {&mlp::model, &gpt::model}) {
        const Plan plan = make_plan(*m, p, 4, precision);
        const std::string problem = check_plan(plan);
        BOOST_TEST(problem.empty(), problem);
        bool copies = false;
        for (const Tensor &t : plan.tensors) { copies |= t.key.slot == Slot::weight_copy && t.key.index == 0; }
        BOOST_TEST(copies == (precision == Precision::bf16));
      }
      if (p != none)
        BOOST_TEST(make_plan(gpt::model, p, 4, precision).activation_bytes <
                       make_plan(gpt::model, none, 4, precision).activation_bytes,
                   policy_name(p).view());
    }
  // the block's LayerNorm outputs are GEMM operands: buffered in the forward that discards
  auto forward_writes_layer_norm_output = [](const Plan &plan) {
    for (const Step &st : plan.train)
      if (st.stage == 1 && st.block == 0 && st.variant == Variant::forward_discard)
        return ranges::any_of(st.args, [](const Arg &a) {
          return a.key.slot == Slot::layer_output && a.key.layer == 1 && a.access == Access::write;
        });
    return false;
  };
  BOOST_TEST(forward_writes_layer_norm_output(make_plan(gpt::model, full, 4, Precision::fp32)));
}

// Backward writes a gradient inside a block over that of its one reader when the reader is
// elementwise (GELU, ReLU, squared ReLU, dropout), chains of them included: the two arguments are
// one tensor in every backward step, and no other two arguments of a step ever are.
BOOST_AUTO_TEST_CASE(elementwise_readers_gradients_are_overwritten_in_place) {
  // gpt: ln 1, qkv 2, attention 3, proj 4, dropout 5, )residual 6, ln 8, fc 9, gelu 10, fc 11, dropout 12
  const Block &t = gpt::model.stages[1];
  const std::map<int, int> gpt_memory = {{1, 1}, {2, 2},  {3, 3},   {4, 5},   {5, 5},  {6, 6},
                                         {8, 8}, {9, 10}, {10, 10}, {11, 12}, {12, 12}};
  for (auto [j, k] : gpt_memory) BOOST_TEST(gradient_memory(t, j) == k, "dh" << j);
  // zoo_gated's second stage: ln 1, fc 2, relu2 3, dropout 4, fc 5, dropout 6, )residual 7
  const Block &z = zoo_gated::model.stages[2];
  const std::map<int, int> zoo_memory = {{1, 1}, {2, 4}, {3, 4}, {4, 4}, {5, 6}, {6, 6}};
  for (auto [j, k] : zoo_memory) BOOST_TEST(gradient_memory(z, j) == k, "zoo dh" << j);
  for (Precision precision : {Precision::fp32, Precision::bf16})
    for (Policy p : all_policies)
      for (const Model *m : {&gpt::model, &zoo_gated::model}) {
        const Plan plan = make_plan(*m, p, 4, precision);
        BOOST_TEST_CONTEXT(label(plan)) {
          int shared = 0;
          for (const Step &st : plan.train)
            for (std::size_t a = 0; a < st.args.size(); ++a)
              for (std::size_t b = a + 1; b < st.args.size(); ++b) {
                const Arg &x = st.args[a], &y = st.args[b];
                const bool pair = x.key.slot == Slot::layer_grad && y.key.slot == Slot::layer_grad &&
                                  gradient_memory(m->stages[st.stage], x.key.layer) ==
                                      gradient_memory(m->stages[st.stage], y.key.layer);
                const bool same = x.tensor == y.tensor;
                // read and written in place: one key, or a gradient and what it accumulates onto
                const bool one_key = x.key == y.key || x.key.slot == Slot::gradient_prev;
                if (same && pair) ++shared;
                if (same && !pair && !one_key)
                  BOOST_TEST(false, name_of(x.key).view() << " and " << name_of(y.key).view() << " share a tensor");
                if (pair) BOOST_TEST(same, name_of(x.key).view() << " and " << name_of(y.key).view());
              }
          BOOST_TEST(shared > 0);
        }
      }
}

// Data-parallel plans hold the gradient exchange's receive buffer: 1 / ranks of the largest
// parameter (rounded up), persistent; one rank's plan has none.
BOOST_AUTO_TEST_CASE(data_parallel_plans_hold_the_exchange_buffer) {
  for (const Model *m : {&gpt::model, &zoo_gated::model}) {
    long long largest = 0;
    for (int s = 0; s < m->n_stages; ++s)
      for (const LocalTensor &lt : params(m->stages[s])) largest = std::max(largest, lt.elements(0));
    for (int ranks : {1, 2, 3}) {
      StagePolicies policies(full);
      policies.ranks = ranks;
      const Plan plan = make_plan(*m, policies, 4, Precision::fp32);
      BOOST_TEST(check_plan(plan) == "");
      std::size_t exchange = 0;
      for (const Tensor &t : plan.tensors)
        if (t.role == Role::exchange) exchange += t.bytes();
      BOOST_TEST(exchange == (ranks == 1 ? 0u : std::size_t((largest + ranks - 1) / ranks * 4)), "ranks " << ranks);
    }
  }
}

// No plan ever holds a [B, H, T, T] tensor: every activation is [R] or [R, w] with w one of the
// model's widths (H T is none of them).
BOOST_AUTO_TEST_CASE(gpt_never_stores_attention_matrices) {
  const long C = gpt::n_embd, H = gpt::n_head;
  const std::set<long> widths = {C, 3 * C, 4 * C, H, gpt::vocab};
  BOOST_TEST(!widths.count(H * gpt::block_size));
  for (Policy p : all_policies) {
    const Plan plan = make_plan(gpt::model, p, 4);
    for (const Tensor &t : plan.tensors)
      if (is_activation(t.role) || t.role == Role::scratch || t.role == Role::gradient) {
        BOOST_TEST_REQUIRE(t.extent[t.dims - 1] == plan.rows, name_of(t.key).view());
        if (t.dims == 2) BOOST_TEST(widths.count(t.extent[0]) == 1u, name_of(t.key).view() << " width " << t.extent[0]);
      }
  }
}

// Offload: each checkpoint is copied out beside the forward that reads it (the copy overlaps
// it), dies after it, and the step after waits for the copy before its memory can be reused
// (the last block's is not offloaded: its restored copy would be needed at once); its restored copy is allocated and
// fetched one step ahead of the first step that reads it, which waits for the arrival. Only checkpoints travel, and
// fewer of them are on the device at once than without offload. Under selective nothing is checkpointed: nothing
// travels.
BOOST_AUTO_TEST_CASE(offload_schedules_transfers_one_step_ahead) {
  for (Policy p : {full, every_2, sqrt_n}) {
    const Plan plain = make_plan(gpt::model, p, 4), plan = make_plan(gpt::model, with_offload(p), 4);
    BOOST_TEST(plain.offload_bytes == 0u);
    BOOST_TEST(plan.offload_bytes > 0u);
    BOOST_TEST(plan.activation_bytes < plain.activation_bytes, policy_name(p).view());
    const auto &train = plan.train;
    std::size_t offloaded = 0;
    int fetched = 0;
    auto binds = [&](const Step &st, int t) {
      return ranges::any_of(st.args, [&](const Arg &a) { return a.tensor == t; });
    };
    auto reads = [&](const Step &st, int t) {
      return ranges::any_of(st.args, [&](const Arg &a) { return a.tensor == t && a.access == Access::read; });
    };
    auto has = [](const std::vector<int> &list, int t) { return ranges::any_of(list, [&](int u) { return u == t; }); };
    for (int i = 0; i < int(train.size()); ++i) {
      for (int x : train[i].offload) {
        offloaded += plan.tensors[x].bytes();
        BOOST_TEST((plan.tensors[x].role == Role::block_input));
        BOOST_TEST(reads(train[i], x));
        BOOST_TEST_REQUIRE(i + 1 < int(train.size()));
        BOOST_TEST(has(train[i].free, x));
        BOOST_TEST(has(train[i + 1].await_out, x));
        for (int j = i + 1; j < int(train.size()); ++j) BOOST_TEST(!binds(train[j], x), "bound after offload");
      }
      for (auto [x, r] : train[i].fetch) {
        ++fetched;
        BOOST_TEST(r != x);
        BOOST_TEST(name_of(plan.tensors[x].key).view() == name_of(plan.tensors[r].key).view());
        BOOST_TEST(plan.tensors[x].bytes() == plan.tensors[r].bytes());
        BOOST_TEST(has(train[i].alloc, r));
        BOOST_TEST(!binds(train[i], r));
        BOOST_TEST_REQUIRE(i + 1 < int(train.size()));
        BOOST_TEST(reads(train[i + 1], r));
        BOOST_TEST(has(train[i + 1].await_in, r));
        bool copied_out_before = false;  // by an earlier step
        for (int j = 0; j < i; ++j) copied_out_before |= has(train[j].offload, x);
        BOOST_TEST(copied_out_before, name_of(plan.tensors[x].key).view());
      }
    }
    BOOST_TEST(offloaded == plan.offload_bytes);
    int checkpoints = 0;
    for (const Step &st : train) checkpoints += int(st.offload.size());
    BOOST_TEST(fetched == checkpoints);
  }
  const Plan sel = make_plan(gpt::model, selective, 4), sel_off = make_plan(gpt::model, with_offload(selective), 4);
  BOOST_TEST(sel_off.offload_bytes == 0u);
  BOOST_TEST(sel_off.activation_bytes == sel.activation_bytes);
  BOOST_TEST(sel_off.peak_bytes == sel.peak_bytes);
}

// AdamW updates every parameter exactly once, in place: each of its steps binds ranges of params,
// grads, adam_m and adam_v at one offset and of one size, reads all four and writes p, m and v
// back over themselves; the ranges tile the flat buffers in order; a parameter is decayed exactly
// when it is a linear's weight.
BOOST_AUTO_TEST_CASE(optimizer_updates_every_parameter_once) {
  for (const Model &m : {small_model(), repeat_first_model(), two_stacks_model(), flat_model(), mlp::model, gpt::model})
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      const Plan plan = make_plan(m, full, 4, precision);
      const std::vector<Tensor> &ts = plan.tensors;
      const int params = plan.params().index;
      struct Range {
        std::size_t begin, end;
        bool decayed;
      };
      std::vector<Range> ranges_;
      for (const Step &st : plan.optimize) {
        BOOST_TEST_REQUIRE((st.variant == Variant::adamw));
        auto bound = [&](Slot slot, Access access) {
          int t = -1, count = 0;
          for (const Arg &a : st.args)
            if (a.key.slot == slot && a.access == access) t = a.tensor, ++count;
          return count == 1 ? t : -1;
        };
        const int p = bound(Slot::adamw_param, Access::read), g = bound(Slot::adamw_grad, Access::read),
                  mm = bound(Slot::adamw_m, Access::read), v = bound(Slot::adamw_v, Access::read);
        BOOST_TEST_REQUIRE((p >= 0 && g >= 0 && mm >= 0 && v >= 0));
        BOOST_TEST(bound(Slot::adamw_param, Access::write) == p);
        BOOST_TEST(bound(Slot::adamw_m, Access::write) == mm);
        BOOST_TEST(bound(Slot::adamw_v, Access::write) == v);
        BOOST_TEST(st.args.size() == 7u);  // nothing else, and the gradients are only read
        const Role roles[4] = {Role::params, Role::grads, Role::adam_m, Role::adam_v};
        const int views[4] = {p, g, mm, v};
        for (int k = 0; k < 4; ++k) {
          const Tensor &t = ts[views[k]];
          BOOST_TEST_REQUIRE(t.view_of >= 0);
          BOOST_TEST((t.role == roles[k] && ts[t.view_of].role == roles[k]), name_of(t.key).view());
          BOOST_TEST(t.offset == ts[p].offset, name_of(t.key).view());
          BOOST_TEST(t.bytes() == ts[p].bytes(), name_of(t.key).view());
        }
        BOOST_TEST(ts[p].offset == (ranges_.empty() ? 0 : ranges_.back().end));
        ranges_.push_back({ts[p].offset, ts[p].offset + ts[p].bytes(), st.weight_decay});
      }
      BOOST_TEST_REQUIRE(!ranges_.empty());
      BOOST_TEST(ranges_.back().end == ts[params].bytes());
      for (const Tensor &t : ts) {
        if (t.role != Role::params || t.view_of < 0 || t.key.stage < 0) continue;
        int in = 0;
        bool decayed = false;
        for (const Range &r : ranges_)
          if (r.begin <= t.offset && t.offset + t.bytes() <= r.end) ++in, decayed = r.decayed;
        BOOST_TEST(in == 1, name_of(t.key).view());
        const bool linear_weight = t.key.op == Op::linear && t.key.index == 0;
        BOOST_TEST(decayed == linear_weight, name_of(t.key).view());
      }
    }
}

// ---------------------------------------------------------------------------------------------
// The budget planner
// ---------------------------------------------------------------------------------------------
namespace {

// Every outcome of every strategy of sub-problem (s, t), by enumeration: its peak, seconds, the
// live bytes of its last step and its steps (counted up to 3); with `prune`, only those no other
// of as many steps beats in peak, last step and seconds together (exact for the least time under
// a peak bound: peaks compose by max and +, times add, and the last step and the steps are all an
// offloaded checkpoint's caller reads). Independent of the planner's code: the memory model
// restated from the schedule the Builder makes.
struct Outcomes {
  long long peak;
  double seconds;
  long long last;
  int steps;
};
using Pairs = std::vector<Outcomes>;
Pairs outcomes(const Chain &c, int s, int t, bool prune, std::map<std::pair<int, int>, Pairs> &memo) {
  if (auto it = memo.find({s, t}); it != memo.end()) return it->second;
  const std::vector<Link> &L = c.links;
  const int n = c.n();
  const long long xs = L[s].x, after = t < n ? L[t + 1].dx : 0;
  Pairs out;
  if (s == n) {
    out.push_back({xs + L[n].dx, L[n].forward_time[0], xs + L[n].dx, 1});
  } else {
    const long long recompute = xs + after + L[s].dx + L[s].backward_temp[2];
    if (s == t && L[s].can[2]) out.push_back({recompute, L[s].backward_time[2], recompute, 1});
    for (int k = 0; k < 2; ++k) {
      if (!L[s].can[k]) continue;
      const long long a = L[s].saved[k], next = s < t ? L[s + 1].dx : after;
      const long long forward = xs + after + L[s].y + a + L[s].forward_temp[k];
      const long long backward = xs + a + next + L[s].dx + L[s].backward_temp[k];
      const double time = L[s].forward_time[k] + L[s].backward_time[k];
      if (s == t)
        out.push_back({std::max(forward, backward), time, backward, 2});
      else
        for (const Outcomes &rest : outcomes(c, s + 1, t, prune, memo))
          out.push_back({std::max({forward, backward, xs + a + rest.peak}), time + rest.seconds, backward, 3});
    }
    // checkpoints: the forward sweep s..u-1 keeps the input of u; offloaded, the input of s is
    // copied out beside the first forward and dies after it, and is fetched beside the last step
    // of (u, t), which must not be the step right after the sweep (nothing would be saved)
    long long sweep = 0, sweep_offloaded = 0;
    double sweep_time = 0;
    for (int u = s + 1; u <= t; ++u) {
      const int j = u - 1;
      const long long at = xs + after + (j > s ? L[j].x : 0) + L[j].y + L[j].forward_temp[2];
      sweep = std::max(sweep, at);
      sweep_offloaded = std::max(sweep_offloaded, j > s ? at - xs : at);
      sweep_time += L[j].forward_time[2];
      const Pairs later = outcomes(c, u, t, prune, memo), again = outcomes(c, s, u - 1, prune, memo);
      for (const Outcomes &l : later)
        for (const Outcomes &r : again) {
          out.push_back({std::max({sweep, xs + l.peak, r.peak}), sweep_time + l.seconds + r.seconds, r.last, 3});
          if (L[s].offload_time >= 0 && (u - s) + l.steps >= 3)
            out.push_back({std::max({sweep_offloaded, l.peak, l.last + xs, r.peak}),
                           sweep_time + l.seconds + r.seconds + L[s].offload_time, r.last, 3});
        }
    }
  }
  if (prune) {
    std::ranges::sort(out, {}, [](const Outcomes &o) { return std::tuple(o.steps, o.peak, o.last, o.seconds); });
    Pairs kept;
    for (const Outcomes &o : out)
      if (std::ranges::none_of(kept, [&](const Outcomes &k) {
            return k.steps == o.steps && k.peak <= o.peak && k.last <= o.last && k.seconds <= o.seconds;
          }))
        kept.push_back(o);
    out = kept;
  }
  return memo[{s, t}] = out;
}

// A chain of `blocks` random blocks between a loose first unit and a loose head, sizes in
// multiples of 64 bytes, random times (the cost model the planner would get from a table).
Chain random_chain(std::mt19937 &rng, int blocks) {
  auto size = [&](int lo, int hi) { return 64LL * std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto time = [&] { return std::uniform_real_distribution<double>(0.1, 5)(rng); };
  Chain c;
  c.persistent = size(10, 100);
  const int units = blocks + 2;
  for (int u = 0; u < units; ++u) {
    Link l;
    const bool loose = u == 0 || u == units - 1;
    l.x = u == 0 ? 0 : c.links.back().y;
    l.y = size(1, 8);
    l.dx = u == 0 ? 0 : l.x;
    l.saved[0] = size(0, 30);
    l.saved[1] = std::uniform_int_distribution<long long>(0, l.saved[0] / 64)(rng) * 64;
    for (int k = 0; k < 3; ++k) {
      l.forward_temp[k] = size(0, 10);
      l.backward_temp[k] = size(0, 20);
      l.forward_time[k] = time();
      l.backward_time[k] = time() + (k == 2 ? l.forward_time[2] : k == 1 ? 0.5 * time() : 0);
    }
    l.can = {true, !loose, !loose};
    // some inputs may wait in host memory (the first unit's is the batch)
    if (u > 0 && std::uniform_int_distribution<int>(0, 2)(rng) > 0) l.offload_time = 0.5 * time();
    c.links.push_back(l);
  }
  Link loss;
  loss.x = c.links.back().y;
  loss.dx = loss.x;
  loss.forward_time[0] = time();
  c.links.push_back(loss);
  return c;
}

// The live bytes at the highest point of the training schedule (persistent tensors included,
// each tensor aligned): what the planner's peak is when its placement leaves no holes.
std::size_t live_peak(const Plan &plan) {
  std::size_t live = 0, high = 0;
  for (const Tensor &t : plan.tensors)
    if (t.view_of < 0 && is_persistent(t.role)) live += align_up(t.bytes());
  for (const Step &st : plan.train) {
    for (int t : st.alloc) live += align_up(plan.tensors[t].bytes());
    high = std::max(high, live);
    for (int t : st.free) live -= align_up(plan.tensors[t].bytes());
  }
  return high;
}

}  // namespace

// On random chains of 1 to 8 blocks, most of whose inputs can be offloaded: the dynamic program's
// time equals the best of every strategy (all of them enumerated up to 5 blocks; 6 to 8 against
// the pruned enumeration, which agrees with the full one where both run) under budgets from the
// least feasible peak up, and its strategy's peak (the planner's memory model, which
// fixed_policies_evaluate_to_their_plans_live_peak and budget_plans_fit_and_their_peak_is_the_dps
// tie to real plans) is within the budget. The least-memory strategy (which does not offload) has the least peak of the
// strategies without offload.
BOOST_AUTO_TEST_CASE(budget_dp_equals_exhaustive_search_on_random_chains) {
  std::mt19937 rng(7);
  int compared = 0, infeasible = 0, offloading = 0;
  for (int trial = 0; trial < 48; ++trial) {
    const int blocks = 1 + trial % 8;
    const Chain c = random_chain(rng, blocks);
    std::map<std::pair<int, int>, Pairs> memo, pruned_memo;
    const Pairs all = outcomes(c, 0, c.n(), blocks > 5, memo);
    if (blocks <= 5) {  // the pruned enumeration agrees with the full one
      const Pairs pruned = outcomes(c, 0, c.n(), true, pruned_memo);
      for (const Outcomes &o : all) {
        double best = 1e300;
        for (const Outcomes &p : pruned)
          if (p.peak <= o.peak) best = std::min(best, p.seconds);
        BOOST_TEST(best <= o.seconds + 1e-9);
      }
    }
    Chain kept_on_device = c;
    for (Link &l : kept_on_device.links) l.offload_time = -1;
    std::map<std::pair<int, int>, Pairs> device_memo;
    long long least_on_device = -1;
    for (const Outcomes &o : outcomes(kept_on_device, 0, c.n(), true, device_memo))
      if (least_on_device < 0 || o.peak < least_on_device) least_on_device = o.peak;
    BOOST_TEST(least_memory(kept_on_device).peak == c.persistent + least_on_device, "blocks " << blocks);
    long long lowest = all.front().peak, highest = 0;
    for (const Outcomes &o : all) lowest = std::min(lowest, o.peak), highest = std::max(highest, o.peak);
    for (int step = 0; step <= 6; ++step) {
      const long long budget = c.persistent + lowest - 64 + (highest - lowest + 128) * step / 6;
      double best = 1e300;
      for (const Outcomes &o : all)
        if (c.persistent + o.peak <= budget) best = std::min(best, o.seconds);
      const BudgetSolution dp = fastest_within(c, budget);
      BOOST_TEST_CONTEXT("blocks " << blocks << " budget " << budget) {
        BOOST_TEST(dp.feasible == (best < 1e300));
        if (!dp.feasible) {
          ++infeasible;
          continue;
        }
        BOOST_TEST(dp.unit == 64);  // exact: every size is a multiple of 64
        BOOST_TEST(std::abs(dp.seconds - best) <= 1e-9 * best);
        BOOST_TEST(dp.peak <= budget);
        offloading += ranges::any_of(dp.strategy.table, [](const Decision &d) { return d.offload; }) ? 1 : 0;
        ++compared;
      }
    }
  }
  BOOST_TEST(compared > 200);
  BOOST_TEST(infeasible > 10);  // the budgets just below the least peak
  BOOST_TEST(offloading > 20);  // plans that offload were among those compared
  BOOST_TEST_MESSAGE("budget DP vs enumeration: " << compared << " budgets compared, " << offloading
                                                  << " of their plans offload");
}

namespace {
// Random models: a loose stem, two repeat stages of random kinds and lengths, a loose head.
Model random_model(std::mt19937 &rng) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int w1 = 4 * pick(2, 6), w2 = 4 * pick(2, 6), h1 = 4 * pick(2, 8), h2 = 4 * pick(2, 8);
  const int n1 = pick(1, 4), n2 = pick(1, 4);
  const Block mlp_block = residual(layer_norm(), linear(w1, h1), gelu(), linear(h1, w1));
  const Block relu_block = chain(linear(w2, h2), relu(), dropout(), linear(h2, w2));
  const Block gelu_block = residual(layer_norm(), linear(w2, h2), gelu(), dropout(), linear(h2, w2), dropout());
  return check(make_model(input(12), linear(12, w1), repeat(n1, mlp_block), layer_norm(), linear(w1, w2),
                          repeat(n2, pick(0, 1) ? relu_block : gelu_block), layer_norm(), linear(w2, 5),
                          softmax_cross_entropy()))
      .model;
}
}  // namespace

// Budget plans of real models (the examples, the planner's test models and random ones), fp32
// and bf16, both GEMM choices, with and without offloading as an option: the plan replays cleanly
// (transfers included), its peak is within the budget, the live bytes at its highest point are
// the dynamic program's peak, and it is never predicted slower than a uniform schedule whose plan
// fits (the table's memory, rounded up near the budget, can miss one).
BOOST_AUTO_TEST_CASE(budget_plans_fit_and_their_peak_is_the_dps) {
  std::mt19937 rng(11);
  std::vector<std::pair<std::string, Model>> models = {{"mlp", mlp::model},
                                                       {"gpt", gpt::model},
                                                       {"small", small_model()},
                                                       {"repeat_first", repeat_first_model()},
                                                       {"two_stacks", two_stacks_model()},
                                                       {"lm_head", lm_head_model()}};
  for (int i = 0; i < 6; ++i) models.push_back({"random" + std::to_string(i), random_model(rng)});
  int plans = 0, offloading = 0, below_smallest = 0, below_offloading = 0;
  long long worst_holes = 0;
  for (const auto &[name, m] : models)
    for (Precision pr : {Precision::fp32, Precision::bf16})
      for (double rate : {0.0, 2e10}) {  // checkpoints kept on the device; offloading an option (a GPU's)
        const int batch = 8;
        const CostModel costs{.transfer_rate = rate};
        const Chain c = chain_of(m, batch, pr, costs);
        const std::size_t lo = smallest_plan(m, batch, pr).peak_bytes, hi = make_plan(m, none, batch, pr).peak_bytes;
        BOOST_TEST(lo <= hi);
        std::vector<Plan> uniform;  // what no budget plan may be predicted slower than, where it fits
        for (const Policy &u : {none, full, sqrt_n, every_n_layers(2), every_n_layers(3)})
          uniform.push_back(make_plan(m, u, batch, pr));
        for (int step = 0; step <= 4; ++step) {
          const long long budget = (long long)(lo + (hi - lo) * step / 4);
          BOOST_TEST_CONTEXT(name << " " << precision_name(pr) << " budget " << budget << " transfer rate " << rate) {
            const Planned p = plan_for(m, remat::budget(budget), batch, pr, costs);
            BOOST_TEST_REQUIRE(p.ok(), p.error.view());
            BOOST_TEST(check_plan(p.plan) == "");
            if (rate == 0) BOOST_TEST(p.plan.offload_bytes == 0u);
            offloading += p.plan.offload_bytes > 0 ? 1 : 0;
            BOOST_TEST((long long)p.plan.peak_bytes <= budget);
            BOOST_TEST((long long)live_peak(p.plan) == c.persistent + evaluate(c, p.plan.strategy, 0, c.n()).peak);
            // never predicted slower than a uniform schedule whose plan fits the budget
            const double seconds = evaluate(c, p.plan.strategy, 0, c.n()).seconds;
            for (const Plan &u : uniform)
              if ((long long)u.peak_bytes <= budget)
                BOOST_TEST(seconds <= evaluate(c, u.strategy, 0, c.n()).seconds * (1 + 1e-12),
                           label(u) << " fits and is predicted faster");
            worst_holes = std::max(worst_holes, (long long)p.plan.peak_bytes - (long long)live_peak(p.plan));
            ++plans;
          }
        }
        // below the least peak: no plan, and the message says how much the smallest needs; where
        // offloading is an option the program is tried first: a plan that fits (by offloading, or
        // by a strategy whose placement leaves fewer holes than the smallest plan's), or the same
        // message saying offload did not fit either
        const Planned below = plan_for(m, remat::budget((long long)lo - 1), batch, pr, costs);
        if (rate == 0 || !below.ok()) {
          BOOST_TEST(!below.ok());
          BOOST_TEST(
              std::string(below.error.view()).find("needs " + std::to_string(lo) + " bytes") != std::string::npos,
              below.error.view());
          if (rate > 0)
            BOOST_TEST(std::string(below.error.view()).ends_with("(offloading checkpoints did not fit either)"));
        } else {
          BOOST_TEST(below.plan.peak_bytes < lo);
          BOOST_TEST(check_plan(below.plan) == "");
          ++below_smallest;
          below_offloading += below.plan.offload_bytes > 0 ? 1 : 0;
        }
      }
  BOOST_TEST(plans == int(models.size()) * 2 * 2 * 5);
  BOOST_TEST(offloading > 20);
  BOOST_TEST_MESSAGE("budget plans: " << offloading << " of " << plans << " offload; " << below_smallest
                                      << " fit below the smallest on-device plan (" << below_offloading
                                      << " offloading); the arena's placement added at most " << worst_holes
                                      << " bytes of holes to the live peak");
}

// The fixed policies, lowered to strategies, give the chain's evaluation the plans' live peaks
// too, offload included: the dynamic program's memory model is the planner's. Batches 8 and 24:
// lm_head_model's fused head in one chunk and in three (an offloaded checkpoint's fetch overlaps
// the last chunk's backward).
BOOST_AUTO_TEST_CASE(fixed_policies_evaluate_to_their_plans_live_peak) {
  for (const Model &m :
       {mlp::model, gpt::model, small_model(), two_stacks_model(), repeat_first_model(), lm_head_model()})
    for (int batch : {8, 24})
      for (const Policy &p : all_policies) {
        const Plan plan = make_plan(m, p, batch, Precision::fp32);
        const Chain c = chain_of(m, batch, Precision::fp32);
        const long long chain_peak = c.persistent + evaluate(c, plan.strategy, 0, c.n()).peak;
        BOOST_TEST((long long)live_peak(plan) == chain_peak,
                   label(plan) << ": live peak " << live_peak(plan) << ", the chain's " << chain_peak);
      }
}

// The fused head (head_stage) runs chunk by chunk (head_chunks): each chunk's forward, loss and
// backward in turn, the backward of every chunk after the first adding to the parameter gradients;
// no tensor of the logits' width holds all rows. Its plans hold no more bytes live at their highest
// point than the same plans with +unfused_head (as many where that point is elsewhere: this small
// model's offloading plans), and placed (first fit) the plans that do not offload peak lower; an
// offloading plan's placement may leave holes (measured: up to 10 KiB more than unfused here). On
// the BPE example (vocabulary 4096) the peak falls by more than the logits' bytes under every
// fixed policy but full, whose next highest point (a block's backward, with the attention's
// per-head gradients) is less than the logits below the unfused peak: there it falls.
BOOST_AUTO_TEST_CASE(fused_head_never_holds_the_whole_logits) {
  const Model m = lm_head_model();
  const int batch = 32, head = head_stage(m);
  BOOST_TEST(head == m.n_stages - 1);
  BOOST_TEST(head_stage(gpt::model) == -1);  // as many classes as features: no LM head by the rule
  BOOST_TEST(head_stage(small_model()) == -1);
  for (Policy p : all_policies)
    for (Precision pr : {Precision::fp32, Precision::bf16}) {
      const std::vector<RowRange> chunks = head_chunks(m, batch, pr);
      BOOST_TEST(chunks.size() == 8u);  // 32 x 64 rows in chunks of 256
      StagePolicies whole(p);
      whole.unfused_head = true;
      const Plan fused = make_plan(m, p, batch, pr);
      const Plan unfused = make_plan(m, whole, batch, pr);
      BOOST_TEST_CONTEXT(label(fused)) {
        BOOST_TEST(check_plan(fused) == "");
        BOOST_TEST(check_plan(unfused) == "");
        BOOST_TEST(std::string(unfused.policy_label.view()).ends_with("+unfused_head"));
        for (const std::vector<Step> *steps : {&fused.train, &fused.eval}) {
          int losses = 0, head_backwards = 0;
          for (const Step &st : *steps) {
            losses += st.variant == Variant::loss;
            if (st.stage == head && is_backward(st.variant)) {
              BOOST_TEST(st.accumulates == (head_backwards > 0));
              ++head_backwards;
            }
            for (int t : st.alloc)
              if (const Tensor &x = fused.tensors[t]; x.dims == 2 && x.extent[0] == m.classes())
                BOOST_TEST(x.extent[1] < fused.rows, name_of(x.key).view());
          }
          BOOST_TEST(losses == int(chunks.size()));
          BOOST_TEST(head_backwards == (steps == &fused.train ? int(chunks.size()) : 0));
        }
        BOOST_TEST(live_peak(fused) <= live_peak(unfused));
        if (!p.offload) BOOST_TEST(fused.peak_bytes < unfused.peak_bytes);
      }
    }
  for (Policy p : {none, selective, every_2, sqrt_n, full})
    for (Precision pr : {Precision::fp32, Precision::bf16}) {
      StagePolicies whole(p);
      whole.unfused_head = true;
      const Plan fused = make_plan(gpt_bpe::model, p, gpt_bpe::trainer.batch, pr);
      const Plan unfused = make_plan(gpt_bpe::model, whole, gpt_bpe::trainer.batch, pr);
      const std::size_t logits = std::size_t(fused.rows * gpt_bpe::vocab * (pr == Precision::bf16 ? 2 : 4));
      BOOST_TEST_CONTEXT(label(fused)) {
        BOOST_TEST(check_plan(fused) == "");
        if (p == full)
          BOOST_TEST(fused.peak_bytes < unfused.peak_bytes);
        else
          BOOST_TEST(fused.peak_bytes + logits <= unfused.peak_bytes);
      }
    }
}

// The head's chunks tile the rows, none below min_kernel_rows, each chunk's rows of the head input
// and of the per-row metrics starting on an arena_alignment boundary; in whole samples where the
// head reads the sequences (attention in the head's stage), else in any rows (a sample of 64 rows
// split into chunks).
BOOST_AUTO_TEST_CASE(head_chunks_tile_the_rows_aligned) {
  const Model attending_head =
      check(make_model(tokens(50, 64), embedding(50, 8), repeat(2, residual(layer_norm(), linear(8, 8))), linear(8, 24),
                       causal_self_attention(2), linear(8, 50), softmax_cross_entropy()))
          .model;
  BOOST_TEST(head_row_unit(attending_head) == 64);
  BOOST_TEST(head_row_unit(lm_head_model()) == 1);
  BOOST_TEST(head_chunks(lm_head_model(), 1, Precision::fp32).size() == 1u);  // 64 rows
  BOOST_TEST(head_chunks(lm_head_model(), 5, Precision::fp32).size() == 2u);  // 256 + 64 rows
  for (const Model &m : {lm_head_model(), mlp::model, gpt::model, attending_head})
    for (Precision pr : {Precision::fp32, Precision::bf16})
      for (int batch = 1; batch <= 70; ++batch) {
        const long long T = m.rows_per_sample(), C = m.stages[m.n_stages - 1].in(),
                        bytes = pr == Precision::bf16 ? 2 : 4;
        long long next = 0;
        for (const RowRange &r : head_chunks(m, batch, pr)) {
          BOOST_TEST(r.first == next);
          BOOST_TEST((r.rows % head_row_unit(m) == 0 && (r.rows >= min_kernel_rows || r.rows == batch * T)));
          BOOST_TEST((r.first * C * bytes) % arena_alignment == 0u);
          BOOST_TEST((r.first * 4) % arena_alignment == 0u);
          next = r.first + r.rows;
        }
        BOOST_TEST(next == batch * T);
      }
}

// The least-memory plan of a deep stack keeps O(1) checkpoints and recomputes O(n^2) forwards
// (the memory-poor schedule of the literature), where full keeps n.
BOOST_AUTO_TEST_CASE(least_memory_is_the_memory_poor_extreme) {
  const Model deep = check(make_model(input(8), linear(8, 16),
                                      repeat(12, residual(layer_norm(), linear(16, 64), gelu(), linear(64, 16))),
                                      layer_norm(), linear(16, 3), softmax_cross_entropy()))
                         .model;
  const Plan least = smallest_plan(deep, 8, Precision::fp32);
  const Plan plan_full = make_plan(deep, full, 8, Precision::fp32);
  auto most_live_block_inputs = [](const Plan &p) {
    int live = 0, most = 0;
    std::vector<char> on(p.tensors.size());
    for (const Step &st : p.train) {
      for (int t : st.alloc)
        if (p.tensors[t].key.slot == Slot::block_output) on[t] = 1, ++live;
      most = std::max(most, live);
      for (int t : st.free)
        if (on[t]) on[t] = 0, --live;
    }
    return most;
  };
  BOOST_TEST_MESSAGE("block outputs live at once: least-memory "
                     << most_live_block_inputs(least) << ", full " << most_live_block_inputs(plan_full)
                     << "; recompute launches " << least.recompute_launches << " vs " << plan_full.recompute_launches);
  BOOST_TEST(least.peak_bytes < plan_full.peak_bytes);
  BOOST_TEST(most_live_block_inputs(least) <= 4);
  BOOST_TEST(most_live_block_inputs(plan_full) >= 12);
  BOOST_TEST(least.recompute_launches > 2 * plan_full.recompute_launches);
}

// A budget fixed in a model module is solved at compile time.
namespace {
constexpr Model budget_model = checked([] {
  return make_model(input(8), linear(8, 16), repeat(6, residual(layer_norm(), linear(16, 32), gelu(), linear(32, 16))),
                    layer_norm(), linear(16, 3), softmax_cross_entropy());
});
static_assert(feasible<budget_model, budget(200 * KiB), 16>());
// Each compile-time solve takes clang ~20 s: the plan's peak is solved once and compared.
constexpr std::size_t compile_time_budget_peak =
    make_plan(budget_model, budget(200 * KiB), 16, Precision::fp32).peak_bytes;
static_assert(compile_time_budget_peak <= 200 * KiB);
static_assert(compile_time_budget_peak > make_plan(budget_model, full, 16, Precision::fp32).peak_bytes);
}  // namespace
BOOST_AUTO_TEST_CASE(a_budget_is_solved_at_compile_time) {
  BOOST_TEST(compile_time_budget_peak == make_plan(budget_model, budget(200 * KiB), 16, Precision::fp32).peak_bytes);
}

// Annotations produce the plan of the equivalent run-time policy, step for step and byte for
// byte: zoo_gated's annotated stages (s1 save_and_offload_only_these_names({"rotated"}, {"gate"}),
// s2 every_n_layers(2) | recompute_modules(norm)) give the plan of the same values set per stage
// at run time over none (the flag "s1:selective,s2:every_n_layers=2+selective" does the same:
// a stage's selective set is its kernels', the annotation's); a schedule-only annotation gives the plan of the same
// layers without it under that schedule; and the named selective set keeps exactly the named outputs (and the row
// statistics).
namespace {
void expect_same_plan(const Plan &a, const Plan &b) {
  BOOST_TEST(a.peak_bytes == b.peak_bytes);
  BOOST_TEST_REQUIRE(a.train.size() == b.train.size());
  BOOST_TEST_REQUIRE(a.tensors.size() == b.tensors.size());
  for (std::size_t t = 0; t < a.tensors.size(); ++t) {
    BOOST_TEST(name_of(a.tensors[t].key).view() == name_of(b.tensors[t].key).view());
    BOOST_TEST(a.tensors[t].offset == b.tensors[t].offset);
    BOOST_TEST(a.tensors[t].bytes() == b.tensors[t].bytes());
  }
  for (std::size_t i = 0; i < a.train.size(); ++i) {
    BOOST_TEST((a.train[i].variant == b.train[i].variant && a.train[i].stage == b.train[i].stage &&
                a.train[i].block == b.train[i].block && a.train[i].alloc == b.train[i].alloc &&
                a.train[i].free == b.train[i].free));
    BOOST_TEST_REQUIRE(a.train[i].args.size() == b.train[i].args.size());
    for (std::size_t k = 0; k < a.train[i].args.size(); ++k)
      BOOST_TEST(a.train[i].args[k].tensor == b.train[i].args[k].tensor);
  }
}
}  // namespace

BOOST_AUTO_TEST_CASE(annotations_equal_the_run_time_policy) {
  const Model &annotated_model = zoo_gated::model;
  Model plain = annotated_model, scheduled = annotated_model;
  for (int s = 0; s < plain.n_stages; ++s) {
    plain.stages[s] = annotated_model.stages[s];
    plain.stages[s].annotated = false;
    plain.stages[s].policy = {};
    scheduled.stages[s] = plain.stages[s];
  }
  scheduled.stages[2].annotated = true;
  scheduled.stages[2].policy = every_n_layers(2);
  {
    StagePolicies flag(none);
    flag.stage[1] = save_and_offload_only_these_names({"rotated"}, {"gate"});
    flag.stage[2] = every_n_layers(2) | selective;
    expect_same_plan(make_plan(annotated_model, annotated(annotated_model, none), 8, Precision::fp32),
                     make_plan(annotated_model, flag, 8, Precision::fp32));
    StagePolicies schedule(none);
    schedule.stage[2] = every_n_layers(2);
    expect_same_plan(make_plan(scheduled, annotated(scheduled, none), 8, Precision::fp32),
                     make_plan(plain, schedule, 8, Precision::fp32));
    BOOST_TEST(policies_name(annotated_model, annotated(annotated_model, none)).view() ==
               "s1:selective(save:rotated;offload:gate),s2:every_n_layers=2+selective(recompute:norm)");
    // stage 1 under selective keeps the outputs of the named layers (rope 3, swiglu 10) and the statistics
    const Plan sel = make_plan(annotated_model, selective, 8, Precision::fp32);
    std::set<std::string> kept;
    for (const Tensor &t : sel.tensors)
      if (t.key.stage == 1 && t.key.block == 0 && t.role == Role::internal)
        kept.insert(str(name_of(t.key.local()).view()));
    BOOST_TEST((kept == std::set<std::string>{"h3", "h10", "rstd1", "rstd8", "att4_lse"}), fmt_set(kept));
  }
}

// Named internals offload (save_and_offload_only_these_names): zoo_gated's first stage keeps
// "rotated" (h3) and offloads "gate" (h10). Each block's h10 is copied out after its forward and
// fetched into a copy that its backward reads; the schedule replays clean (transfers included);
// the activations live at once drop, against the same plan with nothing offloaded.
BOOST_AUTO_TEST_CASE(named_internals_are_offloaded) {
  {
    const StagePolicies with = annotated(zoo_gated::model, selective);
    StagePolicies without = with;
    without.stage[1].selection.offloaded = 0;
    const Plan a = make_plan(zoo_gated::model, with, 8, Precision::fp32);
    const Plan b = make_plan(zoo_gated::model, without, 8, Precision::fp32);
    for (PlanPhase phase : {PlanPhase::train, PlanPhase::optimize, PlanPhase::eval})
      BOOST_TEST(check_schedule(a, phase) == "");
    std::set<std::string> out, in;
    std::size_t host_bytes = 0;
    for (const Step &st : a.train) {
      for (int t : st.offload) {
        out.insert(str(name_of(a.tensors[t].key).view()));
        host_bytes += align_up(a.tensors[t].bytes());
      }
      for (auto [host, into] : st.fetch) {
        in.insert(str(name_of(a.tensors[host].key).view()));
        // the restored copy is read by its own block's selective backward, and by nothing before it
        int reader = -1;
        for (int i = 0; i < int(a.train.size()) && reader < 0; ++i)
          for (const Arg &arg : a.train[i].args)
            if (arg.tensor == into) reader = i;
        BOOST_TEST_REQUIRE(reader >= 0);
        BOOST_TEST((a.train[reader].variant == Variant::backward_selective && a.train[reader].stage == 1 &&
                    a.train[reader].block == a.tensors[host].key.block));
      }
    }
    BOOST_TEST((out == std::set<std::string>{"s1.b0.h10", "s1.b1.h10", "s1.b2.h10"}), fmt_set(out));
    BOOST_TEST(in == out, fmt_set(in));
    BOOST_TEST(a.offload_bytes == host_bytes);
    BOOST_TEST(b.offload_bytes == 0u);
    BOOST_TEST(a.activation_bytes < b.activation_bytes);
  }
}
