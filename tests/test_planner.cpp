// The DSL and the planner: shape inference, policies, and the plan's arena layout checked by an
// independent replay of its schedule.
#include <boost/test/unit_test.hpp>
#include <range/v3/algorithm/any_of.hpp>

#include <algorithm>
#include <set>
#include <vector>
import remat;
import mlp;
import gpt;

using namespace remat;

namespace {

Model small_model() {
  return check(make_model(input(12), linear(12, 16),
                          repeat(5, residual(layer_norm(), linear(16, 32), gelu(), linear(32, 16))),
                          layer_norm(), linear(16, 3), softmax_cross_entropy()))
      .model;
}

const Policy every_2{Policy::Kind::every_n_layers, 2};
const std::vector<Policy> all_policies = {none, full, every_2, sqrt_n, with_offload(full), with_offload(every_2),
                                          with_offload(sqrt_n)};

// Replays a schedule: every tensor a kernel touches is live, and live tensors never overlap.
void check_schedule(const Plan &plan, const std::vector<Step> &steps) {
  std::set<int> live;
  for (int t = 0; t < int(plan.tensors.size()); ++t) {
    const Role r = plan.tensors[t].role;
    if (plan.tensors[t].view_of < 0 && !is_activation(r) && r != Role::gradient && r != Role::scratch)
      live.insert(t);
  }
  auto root = [&](int t) { return plan.tensors[t].view_of < 0 ? t : plan.tensors[t].view_of; };
  for (const Step &st : steps) {
    for (int t : st.alloc) BOOST_TEST_REQUIRE(live.insert(t).second, "allocated twice: " << plan.tensors[t].name.view());
    for (const Arg &a : st.args)
      BOOST_TEST_REQUIRE(live.count(root(a.tensor)) == 1u,
                         "kernel argument " << a.name.view() << " is bound to a dead tensor");
    for (int a : live)
      for (int b : live) {
        if (a >= b) continue;
        const Tensor &x = plan.tensors[a], &y = plan.tensors[b];
        const bool disjoint = x.offset + x.bytes() <= y.offset || y.offset + y.bytes() <= x.offset;
        BOOST_TEST_REQUIRE(disjoint, x.name.view() << " overlaps " << y.name.view());
        BOOST_TEST_REQUIRE(std::max(x.offset + x.bytes(), y.offset + y.bytes()) <=
                           std::max(plan.peak_bytes, plan.eval_peak_bytes));
      }
    for (int t : st.free) BOOST_TEST_REQUIRE(live.erase(t) == 1u, "freed while dead: " << plan.tensors[t].name.view());
  }
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
             "remat: stage 0 layer 2 (causal_self_attention): attention cannot end a block (its backward reads its output)");
  BOOST_TEST(error(make_model(tokens(16, 0), embedding(16, 6), softmax_cross_entropy())) ==
             "remat: tokens(vocab, block_size) needs vocab >= 1 and block_size >= 1");
  BOOST_TEST(error(make_model(input(4), linear(4, 9), causal_self_attention(3), softmax_cross_entropy())) ==
             "remat: stage 0 layer 1 (causal_self_attention): attention needs sequences: tokens(vocab, block_size)");
}

// Plans for shapes the examples do not have: a repeat stage first (its blocks pass input
// gradients to each other), two repeat stages around a loose one (segments stay inside a stage),
// and no repeat stage at all (every policy degenerates to none).
BOOST_AUTO_TEST_CASE(unusual_stacks_plan_consistently) {
  const Model repeat_first = check(make_model(input(8), repeat(3, residual(layer_norm(), linear(8, 8))),
                                              softmax_cross_entropy())).model;
  const Model two_stacks = check(make_model(input(8), repeat(3, residual(linear(8, 8), gelu())), layer_norm(),
                                            repeat(4, residual(linear(8, 8))), softmax_cross_entropy())).model;
  const Model flat = check(make_model(input(8), linear(8, 4), softmax_cross_entropy())).model;
  for (const Model &m : {repeat_first, two_stacks, flat})
    for (Policy p : all_policies) {
      const Plan plan = make_plan(m, p, 8);
      check_schedule(plan, plan.train);
      check_schedule(plan, plan.eval);
      // every backward but the model's very first block produces the gradient of its input
      int with_dx = 0, backwards = 0;
      for (const Step &st : plan.train)
        if (st.variant == Variant::backward_saved || st.variant == Variant::backward_recompute) {
          ++backwards;
          for (const Arg &a : st.args) with_dx += a.name.view() == "dx";
        }
      BOOST_TEST(with_dx == backwards - (m.stages[0].repeat > 1 ? 0 : 1), policy_name(p).view());
    }
  BOOST_TEST(make_plan(flat, sqrt_n, 8).recompute_launches == 0);
  // sqrt_n over 3 + 4 blocks: ceil(sqrt(3)) = 2 segments and ceil(sqrt(4)) = 2, none crossing
  BOOST_TEST(make_plan(two_stacks, sqrt_n, 8).recompute_launches == 2 + 1 + 2 + 2);
}

BOOST_AUTO_TEST_CASE(policies_choose_segments) {
  auto firsts = [](Policy p, int n) {
    std::vector<int> out;
    for (Segment s : segments(p, n)) out.push_back(s.first);
    return out;
  };
  BOOST_TEST(segments(none, 16).empty());
  BOOST_TEST(firsts(full, 4) == (std::vector<int>{0, 1, 2, 3}));
  BOOST_TEST(firsts(Policy{Policy::Kind::every_n_layers, 3}, 10) == (std::vector<int>{0, 3, 6, 9}));
  const auto sq = segments(sqrt_n, 16);  // ceil(sqrt(16)) = 4 segments of 4 blocks
  BOOST_TEST(sq.size() == 4u);
  BOOST_TEST(sq[1].first == 4);
  BOOST_TEST(sq[1].last == 7);
  BOOST_TEST(segments(sqrt_n, 10).size() == 4u);  // ceil(sqrt(10)) = 4 segments, 3+3+3+1
}

BOOST_AUTO_TEST_CASE(every_schedule_replays_without_overlap) {
  for (const Model &m : {small_model(), mlp::model})
    for (Policy p : all_policies)
      for (int batch : {8, 256}) {
        const Plan plan = make_plan(m, p, batch);
        check_schedule(plan, plan.train);
        check_schedule(plan, plan.optimize);
        check_schedule(plan, plan.eval);
        BOOST_TEST(plan.eval_peak_bytes <= plan.peak_bytes);
      }
}

// Activation bytes against a hand count for the MLP (fp32, B rows, C = width, H = hidden):
//   none: 17 block inputs (16 blocks + head) of B*C, per block the internals LayerNorm output
//         (C), linear output (H), GELU output (H) and two row statistics, the head's LayerNorm
//         output and statistics, and the logits (10):   4B (17C + 16 (C + 2H + 2) + C + 2 + 10)
//   full: the 16 block inputs and the head input, plus one block's recomputed internals (the
//         LayerNorm output stays in registers):          4B (17C + 2H + 2)
BOOST_AUTO_TEST_CASE(activation_bytes_match_the_hand_count) {
  const long B = 256, C = mlp::width, H = mlp::hidden;
  const Plan p_none = make_plan(mlp::model, none, B), p_full = make_plan(mlp::model, full, B);
  BOOST_TEST(p_none.activation_bytes == std::size_t(4 * B * (17 * C + 16 * (C + 2 * H + 2) + C + 2 + 10)));
  BOOST_TEST(p_full.activation_bytes == std::size_t(4 * B * (17 * C + 2 * H + 2)));
  BOOST_TEST(p_full.activation_bytes <= p_none.activation_bytes / 4);
  const Plan p_sqrt = make_plan(mlp::model, sqrt_n, B), p_two = make_plan(mlp::model, every_2, B);
  BOOST_TEST(p_sqrt.activation_bytes < p_two.activation_bytes);
  BOOST_TEST(p_two.activation_bytes < p_none.activation_bytes);
}

BOOST_AUTO_TEST_CASE(recompute_launches_per_policy) {
  auto launches = [](Policy p) { return make_plan(mlp::model, p, 64).recompute_launches; };
  BOOST_TEST(launches(none) == 0);
  BOOST_TEST(launches(full) == 16);     // one fused recompute-backward per block
  BOOST_TEST(launches(every_2) == 8);   // blocks 0, 2, ..., 14
  BOOST_TEST(launches(sqrt_n) == 16);   // per segment of 4: 3 forward replays + 1 fused backward
  // Recompute kernels appear only under policies that checkpoint.
  const Plan plan = make_plan(mlp::model, none, 64);
  BOOST_TEST(!ranges::any_of(plan.train, [](const Step &s) { return s.variant == Variant::backward_recompute; }));
}

// The compile-time plan and the run-time plan are the same function of the same inputs.
BOOST_AUTO_TEST_CASE(plan_is_known_at_compile_time) {
  constexpr std::size_t peak = make_plan(mlp::model, full, 32).peak_bytes;
  BOOST_TEST(peak == make_plan(mlp::model, full, 32).peak_bytes);
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
//   selective: 4R (L (9C + H + 4) + 7C)   each block keeps x, qkv (3C), the residual sum (C), the
//              4C MLP hidden; the peak adds the last block's rebuilt LayerNorm outputs (2C),
//              attention output (C) and GELU output (4C) during its backward
//   full:      4R (L C + 15C + H + 4)     one input per block plus one block's internals
BOOST_AUTO_TEST_CASE(gpt_activation_bytes_match_the_hand_count) {
  const long B = 8, T = gpt::block_size, R = B * T, C = gpt::n_embd, H = gpt::n_head, V = gpt::vocab, L = gpt::n_layer;
  auto bytes = [&](Policy p) { return make_plan(gpt::model, p, B).activation_bytes; };
  BOOST_TEST(bytes(none) == std::size_t(4 * R * (L * (16 * C + H + 4) + C + (C + 2) + V)));
  BOOST_TEST(bytes(selective) == std::size_t(4 * R * (L * (9 * C + H + 4) + 7 * C)));
  BOOST_TEST(bytes(full) == std::size_t(4 * R * (L * C + 15 * C + H + 4)));
}

// bf16: the same counts with activations at 2 bytes; the statistics (H attention log-sum-exps
// and 4 LayerNorm statistics per block, 2 for the head's LayerNorm) stay 4 bytes.
BOOST_AUTO_TEST_CASE(gpt_bf16_activation_bytes_match_the_hand_count) {
  const long B = 8, T = gpt::block_size, R = B * T, C = gpt::n_embd, H = gpt::n_head, V = gpt::vocab, L = gpt::n_layer;
  auto bytes = [&](Policy p) { return make_plan(gpt::model, p, B, Precision::bf16).activation_bytes; };
  BOOST_TEST(bytes(none) == std::size_t(2 * R * (L * 16 * C + C + C + V) + 4 * R * (L * (H + 4) + 2)));
  BOOST_TEST(bytes(selective) == std::size_t(2 * R * (L * 9 * C + 7 * C) + 4 * R * L * (H + 4)));
  BOOST_TEST(bytes(full) == std::size_t(2 * R * (L * C + 15 * C) + 4 * R * (H + 4)));
}

// A bf16 plan runs the same steps on the same tensors as the fp32 plan, plus a bf16 copy of each
// linear's weight as kernel workspace; only activation elements shrink. Parameters, their
// gradients, the AdamW moments and statistics stay fp32.
BOOST_AUTO_TEST_CASE(bf16_plans_differ_only_in_activation_sizes) {
  for (Policy p : {none, selective, full, every_2, with_offload(sqrt_n)}) {
    const Plan fp32 = make_plan(gpt::model, p, 4), bf16 = make_plan(gpt::model, p, 4, Precision::bf16);
    BOOST_TEST((bf16.precision == Precision::bf16));
    std::vector<Tensor> same;
    for (const Tensor &t : bf16.tensors) {
      if (!t.name.view().ends_with("_w16")) {
        same.push_back(t);
        continue;
      }
      BOOST_TEST((t.role == Role::scratch && t.elem_bytes == 2 && t.dims == 2), t.name.view());
    }
    BOOST_TEST_REQUIRE(fp32.tensors.size() == same.size());
    BOOST_TEST(fp32.train.size() == bf16.train.size());
    BOOST_TEST(bf16.peak_bytes < fp32.peak_bytes);
    BOOST_TEST(bf16.offload_bytes * 2 == fp32.offload_bytes);
    for (std::size_t i = 0; i < fp32.tensors.size(); ++i) {
      const Tensor &a = fp32.tensors[i], &b = same[i];
      BOOST_TEST(a.name.view() == b.name.view());
      const std::string_view local = a.name.view().substr(a.name.view().rfind('.') + 1);
      const bool statistic = local.starts_with("mean") || local.starts_with("rstd") || local.ends_with("_lse") ||
                             local.ends_with("_delta") || (local.starts_with("s") && a.dims == 1);
      const bool fp32_always = a.role == Role::params || a.role == Role::grads || a.role == Role::adam_m ||
                               a.role == Role::adam_v || a.role == Role::metrics || a.name.view() == "labels" ||
                               a.name.view() == "inputs" || statistic;
      BOOST_TEST(a.elem_bytes == 4);
      BOOST_TEST(b.elem_bytes == (fp32_always ? 4 : 2), a.name.view());
    }
  }
  BOOST_TEST(kernel_name("gpt", 1, Variant::backward_recompute, Precision::bf16).view() == "gpt_s1_backward_recompute_bf16");
  BOOST_TEST(kernel_name("gpt", 0, Variant::adamw, Precision::bf16).view() == "gpt_adamw");
}

// Library-GEMM plans (the CUDA and OpenCL kernels): every linear input and output is a buffer,
// no transposed weight copies (the library transposes), a bf16 copy of each linear's weight in
// bf16 plans; their schedules replay cleanly and keep fewer activations under recompute.
BOOST_AUTO_TEST_CASE(library_gemm_plans_replay_without_overlap) {
  for (Precision precision : {Precision::fp32, Precision::bf16})
    for (Policy p : all_policies) {
      for (const Model *m : {&mlp::model, &gpt::model}) {
        const Plan plan = make_plan(*m, p, 4, precision, Gemms::library);
        BOOST_TEST((plan.gemms == Gemms::library));
        check_schedule(plan, plan.train);
        check_schedule(plan, plan.eval);
        bool copies = false;
        for (const Tensor &t : plan.tensors) {
          BOOST_TEST(!t.name.view().ends_with("_wt"), t.name.view());
          copies |= t.name.view().ends_with("_w16");
        }
        BOOST_TEST(copies == (precision == Precision::bf16));
      }
      if (p != none && !p.offload)
        BOOST_TEST(make_plan(gpt::model, p, 4, precision, Gemms::library).activation_bytes <
                   make_plan(gpt::model, none, 4, precision, Gemms::library).activation_bytes);
    }
  // the block's LayerNorm outputs are GEMM operands: buffered in the forward that discards
  auto forward_writes_layer_norm_output = [](const Plan &plan) {
    for (const Step &st : plan.train)
      if (st.stage == 1 && st.block == 0 && st.variant == Variant::forward_discard)
        return ranges::any_of(st.args, [](const Arg &a) { return a.name.view() == "h1"; });
    return false;
  };
  BOOST_TEST(forward_writes_layer_norm_output(make_plan(gpt::model, full, 4, Precision::fp32, Gemms::library)));
  BOOST_TEST(!forward_writes_layer_norm_output(make_plan(gpt::model, full, 4)));
}

// No plan ever holds a [B, H, T, T] tensor: every activation is [R] or [R, w] with w one of the
// model's widths (H T is none of them).
BOOST_AUTO_TEST_CASE(gpt_never_stores_attention_matrices) {
  const long C = gpt::n_embd, H = gpt::n_head;
  const std::set<long> widths = {C, 3 * C, 4 * C, H, gpt::vocab};
  BOOST_TEST(!widths.count(H * gpt::block_size));
  for (Policy p : {none, selective, full, sqrt_n}) {
    const Plan plan = make_plan(gpt::model, p, 4);
    for (const Tensor &t : plan.tensors)
      if ((is_activation(t.role) || t.role == Role::scratch || t.role == Role::gradient) &&
          !t.name.view().ends_with("_wt")) {  // transposed weights are [O, K] workspace
        BOOST_TEST_REQUIRE(t.extent[t.dims - 1] == plan.rows, t.name.view());
        if (t.dims == 2) BOOST_TEST(widths.count(t.extent[0]) == 1u, t.name.view() << " width " << t.extent[0]);
      }
  }
}

BOOST_AUTO_TEST_CASE(gpt_schedules_replay_without_overlap) {
  for (Policy p : {none, selective, full, every_2, sqrt_n, with_offload(full), with_offload(every_2)}) {
    const Plan plan = make_plan(gpt::model, p, 4);
    check_schedule(plan, plan.train);
    check_schedule(plan, plan.eval);
  }
}

// Offload: each checkpoint is copied out after the forward that reads it, stays in the arena one
// more step (the copy overlaps it) and the step after waits for the copy before its memory can be
// reused; its restored copy is allocated and fetched one step ahead of the first step that reads
// it, which waits for the arrival. Only checkpoints travel, and fewer of them are on the device
// at once than without offload.
BOOST_AUTO_TEST_CASE(offload_schedules_transfers_one_step_ahead) {
  for (Policy p : {full, every_2, sqrt_n}) {
    const Plan plain = make_plan(gpt::model, p, 4), plan = make_plan(gpt::model, with_offload(p), 4);
    BOOST_TEST(plain.offload_bytes == 0u);
    BOOST_TEST(plan.offload_bytes > 0u);
    BOOST_TEST(plan.activation_bytes < plain.activation_bytes, policy_name(p).view());
    const auto &train = plan.train;
    std::size_t offloaded = 0;
    int fetched = 0;
    auto reads = [&](const Step &st, int t) { return ranges::any_of(st.args, [&](const Arg &a) { return a.tensor == t; }); };
    for (int i = 0; i < int(train.size()); ++i) {
      for (int x : train[i].offload) {
        offloaded += plan.tensors[x].bytes();
        BOOST_TEST((plan.tensors[x].role == Role::block_input));
        BOOST_TEST(reads(train[i], x));
        BOOST_TEST_REQUIRE(i + 2 < int(train.size()));
        BOOST_TEST(ranges::any_of(train[i + 1].free, [&](int t) { return t == x; }));
        BOOST_TEST(ranges::any_of(train[i + 2].await_out, [&](int t) { return t == x; }));
        for (int j = i + 1; j < int(train.size()); ++j) BOOST_TEST(!reads(train[j], x), "read after offload");
      }
      for (auto [x, r] : train[i].fetch) {
        ++fetched;
        BOOST_TEST(plan.tensors[x].name.view() == plan.tensors[r].name.view());
        BOOST_TEST(ranges::any_of(train[i].alloc, [&](int t) { return t == r; }));
        BOOST_TEST(!reads(train[i], r));
        BOOST_TEST_REQUIRE(i + 1 < int(train.size()));
        BOOST_TEST(reads(train[i + 1], r));
        BOOST_TEST(ranges::any_of(train[i + 1].await_in, [&](int t) { return t == r; }));
        for (int j = 0; j <= i; ++j) BOOST_TEST(!ranges::any_of(train[j].offload, [&](int t) { return t == r; }));
      }
    }
    BOOST_TEST(offloaded == plan.offload_bytes);
    int checkpoints = 0;
    for (const Step &st : train) checkpoints += int(st.offload.size());
    BOOST_TEST(fetched == checkpoints);
  }
}
