// The generated kernels of the example models, run through the executor, against a plain C++
// float64 implementation of the same models (the MLP, and the GPT with dropout), and of the
// registry's other models (a reference walked from each one's layer list); gradient accumulation
// and AdamW against plain C++ arithmetic. (The policies against each other, bit for bit: test_arena.)
//
// The float64 reference wires each model by hand from its own description of the examples (the
// table above mlp_reference / gpt_reference), not from the DSL's graph helpers, so a wiring
// mistake in the DSL is not shared by the reference. Every comparison goes through
// testing::compare (tests/compare.h): element-wise, |got - ref| <= atol * scale + rtol * |ref|,
// which fails on a NaN or an infinity. Each test states its Tolerance and the worst error it
// observed (REMAT_SHOW_ERRORS=1 prints them per tensor).
#include <boost/test/unit_test.hpp>

#include "compare.h"
#include "counter_hash_ref.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>
#include "registry.h"

#include "model_run.h"
#include "kind_reference.h"
#include "kind_references.h"  // generated: every kind's reference.h (generators/kinds/list.h)

using namespace remat;
using remat::runtime::Device;
using remat::runtime::Executor;
using remat::testing::Comparison;
using remat::testing::Tolerance;

namespace {

constexpr int batch = 8;  // MLP samples per micro-batch (the GPT runs 2 sequences)

// ---- float64 reference layers ----
using Rows = std::vector<double>;  // [R, width] row-major

// Where a layer sits in the plan: layer k of block `block` of stage `stage` (its parameters and
// their gradients are the plan's tensors of those keys), and its dropout mask uses counter block
// rng + k, rng = 64 * (the plan's unit index: the blocks of all stages in order), as the planner's
// Unit::rng and the kernels' dropout_at(k).
struct Site {
  int stage, block, k;
  std::uint64_t rng;
  // The plan's key of parameter `index` of this layer (of kind op), or of its gradient.
  TensorKey parameter(Op op, int index) const { return key::of(Slot::parameter, op, k, index).at(stage, block); }
  TensorKey gradient(Op op, int index) const { return key::gradient(parameter(op, index)); }
};
// Layer k of block `block` of stage `stage`, which is unit `unit` of the plan.
Site site(int stage, int block, int unit, int k) { return {stage, block, k, std::uint64_t(unit) * 64}; }

// The layers as the reference sees them (widths written out, not inferred by the DSL).
Layer linear_layer(int in, int out) { return {Op::linear, in, out}; }
Layer layer_norm_layer(int c) { return layer_norm(c); }
Layer gelu_layer(int c) { return {Op::gelu, c, c}; }
Layer dropout_layer(int c) { return {Op::dropout, c, c}; }
Layer attention_layer(int c, int heads, int T) {
  return {.op = Op::attention, .in = 3 * c, .out = c, .heads = heads, .kv_heads = heads, .block_size = T};
}
Layer embedding_layer(int vocab, int c, int T) {
  return {.op = Op::embedding, .in = 1, .out = c, .vocab = vocab, .block_size = T};
}

Rows plus(Rows a, const Rows &b) {
  for (std::size_t e = 0; e < a.size(); ++e) a[e] += b[e];
  return a;
}

struct Reference {
  Executor &ex;
  double dropout = 0;
  std::uint64_t seed = 0, step = 0;
  long rows = 0;
  std::map<TensorKey, Rows> grads;  // by the plan's key
  int duplicate_grads = 0;          // a gradient written twice: a wiring mistake of the reference
  Rows row_loss;                    // [R]

  std::vector<double> param(const TensorKey &k) const {
    auto p = ex.tensor<float>(ex.plan.at(k));
    return {p.begin(), p.end()};
  }
  // A shared parameter's (remat::tied_to) gradient is the sum of its uses' contributions.
  std::set<TensorKey> shared;
  void put_grad(const TensorKey &k, Rows g) {
    const auto [it, added] = grads.emplace(k, g);
    if (added) return;
    if (!shared.count(k)) {
      ++duplicate_grads;
      return;
    }
    for (std::size_t e = 0; e < g.size(); ++e) it->second[e] += g[e];
  }
  using Saved = testing::Saved;
  double keep(const Site &s, std::uint64_t element) const {  // 0 or 1 / (1 - p), as the kernels
    if (dropout == 0) return 1;
    const double scale = double(float(1.0 / (1.0 - dropout)));
    return testing::keep_ref(seed, step, s.rng + s.k, element, dropout) ? scale : 0.0;
  }

  Rows layer_forward(const Layer &l, const Site &site, const Rows &x, Saved &s);
  Rows layer_backward(const Layer &l, const Site &site, const Saved &s, const Rows &dy);

  // Layers applied one after another (a stem, a head, one residual branch); backward runs them
  // in reverse and returns the gradient of the chain's input.
  struct Chain {
    struct Applied {
      Layer layer;
      Site site;
      Saved saved;
    };
    std::vector<Applied> applied;
  };
  Rows forward(Chain &c, const Layer &l, const Site &s, const Rows &x) {
    c.applied.push_back({l, s, {}});
    return layer_forward(l, s, x, c.applied.back().saved);
  }
  Rows backward(Chain &c, Rows dy) {
    for (auto a = c.applied.rbegin(); a != c.applied.rend(); ++a) dy = layer_backward(a->layer, a->site, a->saved, dy);
    return dy;
  }

  // Softmax cross entropy of logits [R, K]: the row losses, and the gradient of their mean.
  Rows cross_entropy(const Rows &x, int K) {
    auto labels = ex.tensor<std::int32_t>(ex.plan.labels());
    Rows d(x.size());
    row_loss.assign(rows, 0.0);
    for (long b = 0; b < rows; ++b) {
      double mx = x[b * K], z = 0;
      for (int k = 0; k < K; ++k) mx = std::max(mx, x[b * K + k]);
      for (int k = 0; k < K; ++k) z += std::exp(x[b * K + k] - mx);
      row_loss[b] = mx + std::log(z) - x[b * K + labels[b]];
      for (int k = 0; k < K; ++k) d[b * K + k] = (std::exp(x[b * K + k] - mx) / z - (k == labels[b])) / rows;
    }
    return d;
  }
};

// ---- the layer kinds' float64 references (generators/kinds/<kind>/reference.h) ----
// One layer of the run as its kind's reference sees it: its parameters and gradients are the
// plan's tensors of their keys at its site, its dropout mask the kernels' there.
class RunSite final : public testing::LayerSite {
public:
  RunSite(Reference &r, const Layer &l, const Site &site) : ref(r), op(l.op), site(site), layer(l) {
    rows = r.rows;
    if (l.tied()) ref.shared.insert(key::gradient(tied_key()));
  }
  // A tied linear's weight [K, O] is its target's token table [O, K], transposed.
  std::vector<double> param(int index) const override {
    if (index == 0 && layer.tied()) return transposed(ref.param(tied_key()), layer.out, layer.in);
    return ref.param(site.parameter(op, index));
  }
  void put_grad(int index, Rows g) override {
    if (index == 0 && layer.tied())
      ref.put_grad(key::gradient(tied_key()), transposed(g, layer.in, layer.out));
    else
      ref.put_grad(site.gradient(op, index), std::move(g));
  }
  double keep(std::uint64_t element) const override { return ref.keep(site, element); }
  std::vector<std::int32_t> tokens() const override {
    auto t = ref.ex.tensor<std::int32_t>(ref.ex.plan.inputs());
    return {t.begin(), t.end()};
  }

private:
  TensorKey tied_key() const {
    return key::of(Slot::parameter, Op::embedding, layer.tie_layer, 0).at(layer.tie_stage, 0);
  }
  static Rows transposed(const std::vector<double> &m, int rows, int cols) {  // [rows, cols] -> [cols, rows]
    Rows t(m.size());
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) t[std::size_t(c) * rows + r] = m[std::size_t(r) * cols + c];
    return t;
  }
  Reference &ref;
  Op op;
  Site site;
  Layer layer;
};

// By Op, from generators/kinds/list.h; the residual markers are wiring (the model descriptions,
// zoo_reference), not layers.
const std::array<testing::ReferenceEntry, n_ops> kind_references = {{
#define REMAT_KIND(name) testing::reference_entry<Op::name>(),
#include "kinds/list.h"
#undef REMAT_KIND
}};

// A layer's entry; a kind without reference.h in its folder stops the test, named.
const testing::ReferenceEntry &reference_of(const Layer &l) {
  const testing::ReferenceEntry &e = kind_references[std::size_t(l.op)];
  BOOST_TEST_REQUIRE((e.forward && e.backward),
                     "kind " << kind(l.op).name << " has no float64 reference (reference.h)");
  return e;
}

Rows Reference::layer_forward(const Layer &l, const Site &site, const Rows &x, Saved &s) {
  RunSite at(*this, l, site);
  s.in = x;
  s.out = reference_of(l).forward(at, l, x, s);
  return s.out;
}
Rows Reference::layer_backward(const Layer &l, const Site &site, const Saved &s, const Rows &dy) {
  RunSite at(*this, l, site);
  return reference_of(l).backward(at, l, s, dy);
}

// ---- the examples, described by hand ----
// k is the position of a layer in its stage's layer list, residual markers counted (as the plan
// names parameters); the unit is the block's position among all blocks of all stages.
//
// MLP (examples/mlp/mlp.cppm), width W = 256, hidden 2W, 16 blocks, 10 classes:
//   stage 0, unit 0, stem:    0 linear 784 -> W
//   stage 1, units 1..16:     0 residual(  1 layer_norm  2 linear W -> 2W  3 gelu  4 linear 2W -> W
//                             5 )residual                       y = x + lin4(gelu3(lin2(ln1(x))))
//   stage 2, unit 17, head:   0 layer_norm  1 linear W -> 10, then softmax cross entropy
//
// GPT (examples/gpt/gpt.cppm), C = 128, 4 heads, T = 64, vocab 128, 6 blocks:
//   stage 0, unit 0, stem:    0 embedding (token table p0_w, positions p0_b)  1 dropout
//   stage 1, units 1..6:      0 residual(  1 layer_norm  2 linear C -> 3C  3 causal attention
//                             4 linear C -> C  5 dropout  6 )residual      a = x + drop5(lin4(att3(lin2(ln1(x)))))
//                             7 residual(  8 layer_norm  9 linear C -> 4C  10 gelu  11 linear 4C -> C
//                             12 dropout  13 )residual                    y = a + drop12(lin11(gelu10(lin9(ln8(a)))))
//   stage 2, unit 7, head:    0 layer_norm  1 linear C -> vocab, then softmax cross entropy
//
// The description is checked against the models once: which op sits at which k (no wiring).
void expect_stage(const Model &m, int stage, int repeat, std::vector<Op> ops) {
  const Block &b = m.stages[stage];
  BOOST_TEST(b.repeat == repeat, "stage " << stage);
  BOOST_TEST_REQUIRE(b.n_layers == int(ops.size()), "stage " << stage);
  for (int k = 0; k < b.n_layers; ++k)
    BOOST_TEST((b.layers[k].op == ops[k]), "stage " << stage << " layer " << k << " is " << op_name(b.layers[k].op));
}
void expect_mlp_description() {
  BOOST_TEST_REQUIRE(mlp::model.n_stages == 3);
  expect_stage(mlp::model, 0, 1, {Op::linear});
  expect_stage(mlp::model, 1, mlp::blocks,
               {Op::residual_begin, Op::layer_norm, Op::linear, Op::gelu, Op::linear, Op::residual_end});
  expect_stage(mlp::model, 2, 1, {Op::layer_norm, Op::linear});
}
void expect_gpt_description() {
  BOOST_TEST_REQUIRE(gpt::model.n_stages == 3);
  expect_stage(gpt::model, 0, 1, {Op::embedding, Op::dropout});
  expect_stage(
      gpt::model, 1, gpt::n_layer,
      {Op::residual_begin, Op::layer_norm, Op::linear, Op::attention, Op::linear, Op::dropout, Op::residual_end,
       Op::residual_begin, Op::layer_norm, Op::linear, Op::gelu, Op::linear, Op::dropout, Op::residual_end});
  expect_stage(gpt::model, 2, 1, {Op::layer_norm, Op::linear});
}

// Forward, loss and backward of the MLP, into r.row_loss and r.grads.
void mlp_reference(Reference &r) {
  constexpr int image_pixels = mlp::image_pixels, width = mlp::width, hidden = mlp::hidden, blocks = mlp::blocks,
                classes = mlp::classes;
  const std::vector<float> images = r.ex.values(r.ex.plan.inputs());  // fp32, or bf16 widened
  Rows x(images.begin(), images.end());
  Reference::Chain stem, head;
  std::vector<Reference::Chain> branch(blocks);
  x = r.forward(stem, linear_layer(image_pixels, width), site(0, 0, 0, 0), x);
  for (int i = 0; i < blocks; ++i) {
    auto at = [&](int k) { return site(1, i, 1 + i, k); };
    Rows h = r.forward(branch[i], layer_norm_layer(width), at(1), x);
    h = r.forward(branch[i], linear_layer(width, hidden), at(2), h);
    h = r.forward(branch[i], gelu_layer(hidden), at(3), h);
    h = r.forward(branch[i], linear_layer(hidden, width), at(4), h);
    x = plus(x, h);  // 5: )residual
  }
  x = r.forward(head, layer_norm_layer(width), site(2, 0, 1 + blocks, 0), x);
  x = r.forward(head, linear_layer(width, classes), site(2, 0, 1 + blocks, 1), x);
  Rows d = r.backward(head, r.cross_entropy(x, classes));
  for (int i = blocks - 1; i >= 0; --i) d = plus(d, r.backward(branch[i], d));
  r.backward(stem, d);
}

// Forward, loss and backward of the GPT, into r.row_loss and r.grads.
void gpt_reference(Reference &r) {
  constexpr int C = gpt::n_embd, vocab = gpt::vocab, block_size = gpt::block_size, n_layer = gpt::n_layer,
                n_head = gpt::n_head;
  Reference::Chain stem, head;
  std::vector<Reference::Chain> attention_branch(n_layer), mlp_branch(n_layer);
  Rows x = r.forward(stem, embedding_layer(vocab, C, block_size), site(0, 0, 0, 0), {});  // reads the tokens
  x = r.forward(stem, dropout_layer(C), site(0, 0, 0, 1), x);
  for (int i = 0; i < n_layer; ++i) {
    auto at = [&](int k) { return site(1, i, 1 + i, k); };
    Reference::Chain &a = attention_branch[i], &f = mlp_branch[i];
    Rows h = r.forward(a, layer_norm_layer(C), at(1), x);
    h = r.forward(a, linear_layer(C, 3 * C), at(2), h);
    h = r.forward(a, attention_layer(C, n_head, block_size), at(3), h);
    h = r.forward(a, linear_layer(C, C), at(4), h);
    h = r.forward(a, dropout_layer(C), at(5), h);
    x = plus(x, h);  // 6: )residual
    h = r.forward(f, layer_norm_layer(C), at(8), x);
    h = r.forward(f, linear_layer(C, 4 * C), at(9), h);
    h = r.forward(f, gelu_layer(4 * C), at(10), h);
    h = r.forward(f, linear_layer(4 * C, C), at(11), h);
    h = r.forward(f, dropout_layer(C), at(12), h);
    x = plus(x, h);  // 13: )residual
  }
  x = r.forward(head, layer_norm_layer(C), site(2, 0, 1 + n_layer, 0), x);
  x = r.forward(head, linear_layer(C, vocab), site(2, 0, 1 + n_layer, 1), x);
  Rows d = r.backward(head, r.cross_entropy(x, vocab));
  for (int i = n_layer - 1; i >= 0; --i) {
    d = plus(d, r.backward(mlp_branch[i], d));
    d = plus(d, r.backward(attention_branch[i], d));
  }
  r.backward(stem, d);
}

// Any model, wired from its layer list with a tape of its own (not the DSL's source and skip
// helpers): residual( keeps the running value, )residual adds it back; backward replays the tape
// in reverse, the sum's gradient going to the branch and, at the matching residual(, to the skip.
void zoo_reference(Reference &r, const Model &m) {
  struct Event {
    enum class What { layer, open, close } what;
    Layer layer{};
    Site site{};
    Reference::Saved saved{};
  };
  std::vector<Event> tape;
  Rows x;
  if (!m.token_input()) {
    const std::vector<float> inputs = r.ex.values(r.ex.plan.inputs());
    x.assign(inputs.begin(), inputs.end());
  }
  std::vector<Rows> skips;
  for (int s = 0, unit = 0; s < m.n_stages; ++s)
    for (int b = 0; b < m.stages[s].repeat; ++b, ++unit)
      for (int k = 0; k < m.stages[s].n_layers; ++k) {
        const Layer &l = m.stages[s].layers[k];
        if (l.op == Op::residual_begin) {
          skips.push_back(x);
          tape.push_back({Event::What::open});
        } else if (l.op == Op::residual_end) {
          x = plus(x, skips.back());
          skips.pop_back();
          tape.push_back({Event::What::close});
        } else {
          tape.push_back({Event::What::layer, l, site(s, b, unit, k)});
          x = r.layer_forward(l, tape.back().site, x, tape.back().saved);
        }
      }
  Rows d = r.cross_entropy(x, m.classes());
  std::vector<Rows> skip_grads;
  for (auto e = tape.rbegin(); e != tape.rend(); ++e) {
    if (e->what == Event::What::close) {
      skip_grads.push_back(d);
    } else if (e->what == Event::What::open) {
      d = plus(d, skip_grads.back());
      skip_grads.pop_back();
    } else {
      d = r.layer_backward(e->layer, e->site, e->saved, d);
    }
  }
}

// ---- kernels against the reference ----
// The per-layer gradient tensors of a plan (views into the flat gradient buffer), by key.
std::vector<TensorKey> grad_tensors(const Plan &plan) {
  std::vector<TensorKey> out;
  for (const Tensor &t : plan.tensors)
    if (t.role == Role::grads && t.key.layer >= 0) out.push_back(t.key);
  return out;
}

using Wiring = std::function<void(Reference &)>;

struct Limits {
  Tolerance loss;   // the row losses (scale: the largest row loss)
  Tolerance grads;  // each gradient tensor (scale: its largest reference magnitude)
};

// The reference of run's current micro-batch.
Reference reference_of(Run &run, Wiring wiring, double dropout) {
  Reference ref{run.ex, dropout, run.scalars.seed, std::uint64_t(run.scalars.step), long(run.plan.rows)};
  wiring(ref);
  return ref;
}

// Kernels against the reference: every row loss and every gradient tensor within `limits`, and
// the reference computes exactly the plan's gradient tensors, each once.
void check_against_reference(Run &run, Wiring wiring, double dropout, Limits limits, std::string_view what) {
  run.ex.run(Executor::Phase::train);
  const Reference ref = reference_of(run, wiring, dropout);
  const Comparison loss = testing::compare(run.ex.tensor<float>(run.plan.row_loss()), ref.row_loss, limits.loss);
  BOOST_TEST(loss.ok(), what << " row losses: " << loss.describe());
  BOOST_TEST(ref.duplicate_grads == 0);
  std::set<TensorKey> planned, computed;
  for (const TensorKey &k : grad_tensors(run.plan)) planned.insert(k);
  for (const auto &[k, g] : ref.grads) computed.insert(k);
  BOOST_TEST_REQUIRE(!planned.empty(), what << ": the plan has no gradient tensors");
  BOOST_TEST((planned == computed), what << ": the reference computes " << computed.size()
                                         << " gradient tensors, the plan has " << planned.size());
  double worst = 0;
  std::string worst_name;
  for (const auto &[k, g] : ref.grads) {
    if (!planned.count(k)) continue;
    const std::string name(name_of(k).view());
    const Comparison c = testing::compare(run.ex.tensor<float>(run.plan.at(k)), g, limits.grads);
    BOOST_TEST(c.ok(), what << " " << name << ": " << c.describe());
    if (c.worst_of_scale >= worst) worst = c.worst_of_scale, worst_name = name;
    if (testing::show_errors()) BOOST_TEST_MESSAGE(what << " " << name << ": " << c.describe());
  }
  if (testing::show_errors())
    BOOST_TEST_MESSAGE(what << ": worst row-loss error " << loss.worst_of_scale << " of scale; worst gradient error "
                            << worst << " of scale (" << worst_name << ")");
}

}  // namespace

// ---- tolerances of the reference tests ----
// atol is a fraction of each tensor's largest reference magnitude (of the largest row loss for
// the losses), rtol 0: an entry's rounding error is set by the terms summed into it. Observed
// figures are the worst over all tensors of the test (REMAT_SHOW_ERRORS=1), from the CPU kernels,
// which are built for pinned CPU features (the same code on every machine that runs them).
//
// float32: rounding (2^-24 relative) through up to 18 blocks, sums of up to 1024 terms.
//   MLP: gradients 1e-5 (observed 2.7e-6, s1.b10.g1_w); row losses 1e-6 (observed 2.0e-7).
constexpr Limits mlp_fp32{.loss = {1e-6, 0}, .grads = {1e-5, 0}};
//   GPT: gradients 5e-6 (observed 1.05e-6, s1.b5.g8_w, under none and selective alike); row
//   losses 1e-6 (observed 1.5e-7).
constexpr Limits gpt_fp32{.loss = {1e-6, 0}, .grads = {5e-6, 0}};
// bf16: every layer output and activation gradient is rounded to bf16 (up to 2^-9 relative
// each), GEMM operands included, through up to 18 blocks.
//   MLP: gradients 5e-2 (observed 2.3e-2, s1.b14.g2_w); row losses 1e-2 (observed 2.9e-3).
constexpr Limits mlp_bf16{.loss = {1e-2, 0}, .grads = {5e-2, 0}};
//   GPT: gradients 3e-2 (observed 1.30e-2, s1.b5.g8_w, under none, selective and full alike);
//   row losses 5e-3 (observed 1.6e-3).
constexpr Limits gpt_bf16{.loss = {5e-3, 0}, .grads = {3e-2, 0}};

//   Zoo fp32: gradients 4e-6 (observed 7.0e-7 zoo_rows, 8.8e-7 zoo_gated on AMD EPYC; 1.7e-6 when
//   zoo_gated's second stage had a ReLU); row losses 5e-7 (observed 7.5e-8, 1.1e-7).
constexpr Limits zoo_fp32{.loss = {5e-7, 0}, .grads = {4e-6, 0}};
//   Zoo bf16, 4x the rows: gradients 8e-2 (observed: zoo_gated 6.8e-2 in s1.b0.g1_w, its first
//   RMSNorm weight, farthest from the loss, since its second stage's activation is a squared ReLU:
//   2.5e-2 with the GELU there before; zoo_rows 2.9e-2 with Halide GEMMs, 0.22 with MKL's, which
//   round more often: NO_BF16_REFERENCE, tests/CMakeLists.txt); row losses 1e-2 (observed 2.3e-3,
//   5.0e-3). relu2 (x^2, derivative 2x) doubles the relative effect of a bf16 rounding of
//   its input on both its output and its gradient. A ReLU makes this comparison ill-conditioned:
//   pre-activations within bf16 rounding of 0 switch their gradient term on or off (zoo_gated with
//   a ReLU there showed 0.16 of scale in a bias gradient), so zoo_gated's bf16 check has no ReLU;
//   the float32 check above pins the rules, ReLU's and relu2's included.
constexpr Limits zoo_bf16{.loss = {1e-2, 0}, .grads = {8e-2, 0}};

// The MLP's float32 kernels against the reference (limits mlp_fp32), and the description of
// the MLP against the model.
BOOST_AUTO_TEST_CASE(kernels_match_the_float64_reference) {
  expect_mlp_description();
  Run run(mlp::model, "mlp", mlp_kernels::table, none, batch);
  check_against_reference(run, mlp_reference, 0, mlp_fp32, "mlp fp32");
}

// The GPT at two sequences with dropout 0.1: attention, embedding and the dropout masks (from
// the same counters as the kernels) against the reference, with and without selective recompute
// (limits gpt_fp32).
BOOST_AUTO_TEST_CASE(gpt_kernels_match_the_float64_reference) {
  expect_gpt_description();
  for (Policy p : {none, selective}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1);
    check_against_reference(run, gpt_reference, 0.1, gpt_fp32, "gpt fp32 " + std::string(policy_name(p).view()));
  }
}

// bf16 kernels against the same float64 reference (limits mlp_bf16, gpt_bf16). Any mistake in
// the bf16 plumbing (a tensor read with the wrong element type, a missing widening) gives
// errors far beyond them; the rules themselves are pinned by the float32 tests.
BOOST_AUTO_TEST_CASE(bf16_kernels_match_the_float64_reference) {
  Run mlp_run(mlp::model, "mlp", mlp_kernels::table, none, batch, 0, true, Device::cpu, Precision::bf16);
  check_against_reference(mlp_run, mlp_reference, 0, mlp_bf16, "mlp bf16");
  for (Policy p : {none, selective, full}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true, Device::cpu, Precision::bf16);
    check_against_reference(run, gpt_reference, 0.1, gpt_bf16, "gpt bf16 " + std::string(policy_name(p).view()));
  }
}

// The registry's models other than the examples (tests/registry.h: a model unlike the examples and
// the model zoo: ReLU, SwiGLU, RMSNorm, linears without bias, blocks without a residual, dropout
// after activations and GEMMs, grouped-query heads) against the float64 reference wired from each
// model's own layer list, at their dropout, fp32 under none and selective and (unless the registry
// says NO_BF16_REFERENCE) bf16 under none, at their first micro-batch (bf16: 4 times it; limits
// zoo_fp32, zoo_bf16).
BOOST_AUTO_TEST_CASE(zoo_kernels_match_the_float64_reference) {
  int checked = 0;
  for (const testing::TestModel &z : testing::test_models()) {
    if (z.example) continue;  // described by hand above
    ++checked;
    const Wiring wiring = [&z](Reference &r) { zoo_reference(r, z.model); };
    const int samples = z.samples[0];
    for (Policy p : {none, selective}) {
      Run run(z.model, z.name, z.cpu, p, samples, z.dropout);
      check_against_reference(run, wiring, z.dropout, zoo_fp32,
                              std::string(z.name) + " fp32 " + std::string(policy_name(p).view()));
    }
    if (!z.bf16_reference) continue;
    Run run(z.model, z.name, z.cpu, none, 4 * samples, z.dropout, true, Device::cpu, Precision::bf16);
    check_against_reference(run, wiring, z.dropout, zoo_bf16, std::string(z.name) + " bf16");
  }
  BOOST_TEST(checked >= 2, checked << " non-example models in the registry");
}

// The comparison the reference tests use catches what the old max-error check let through: NaN
// (which std::max dropped: an all-NaN gradient reported error 0), here one planted NaN, and a
// sign flip of an element of about 5e-4 of the tensor's scale (an error of 1e-3 of scale, under
// the old 2e-3 limit). The gradient is a real kernel output, the tolerance the MLP's float32
// one; the unplanted copy passes.
BOOST_AUTO_TEST_CASE(the_comparison_rejects_a_planted_nan_and_a_planted_sign_flip) {
  Run run(mlp::model, "mlp", mlp_kernels::table, none, batch);
  run.ex.run(Executor::Phase::train);
  const Reference ref = reference_of(run, mlp_reference, 0);
  const TensorKey name = key::gradient(key::parameter(mlp::model.stages[1], 2, 0)).at(1, 0);  // s1.b0.g2_w
  const Rows &want = ref.grads.at(name);
  const auto kernel = run.ex.tensor<float>(run.plan.at(name));
  const std::vector<float> got(kernel.begin(), kernel.end());
  const Tolerance tol = mlp_fp32.grads;
  BOOST_TEST(testing::compare(got, want, tol).ok(), testing::compare(got, want, tol).describe());

  std::vector<float> nan = got;
  nan[nan.size() / 2] = std::numeric_limits<float>::quiet_NaN();
  BOOST_TEST(testing::compare(nan, want, tol).mismatches == 1u);
  const std::vector<float> all_nan(got.size(), std::numeric_limits<float>::quiet_NaN());
  BOOST_TEST(testing::compare(all_nan, want, tol).mismatches == got.size());

  double scale = 0;
  for (double g : want) scale = std::max(scale, std::abs(g));
  std::size_t small = 0;  // the element nearest 5e-4 of scale
  for (std::size_t i = 0; i < want.size(); ++i)
    if (std::abs(std::abs(want[i]) - 5e-4 * scale) < std::abs(std::abs(want[small]) - 5e-4 * scale)) small = i;
  BOOST_TEST(std::abs(want[small]) < 1e-3 * scale);
  std::vector<float> flipped = got;
  flipped[small] = -flipped[small];
  BOOST_TEST(testing::compare(flipped, want, tol).mismatches == 1u);
}

// ---- policies against each other ----
// A bit-identity baseline must be a real gradient: two runs that both wrote NaN, or both left
// the zeros, would compare equal too.
void expect_real_gradient(const std::vector<float> &g) { BOOST_TEST(testing::finite_and_nonzero(g)); }
bool same_bits(const std::vector<float> &a, const std::vector<float> &b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// That every policy (offload and budgets included) gives the gradients of none bit for bit, fp32 and
// bf16 (where rounding happens where each value is defined, so a recompute rounds exactly as the
// first computation did), is test_arena's real_kernels_keep_the_guarantees, on every test model.

// ---- gradient accumulation ----
namespace {
// Replaces run's micro-batch by another one drawn from `seed` (other inputs and labels than the
// Run's own), on the host and the device.
void load_other_batch(Run &run, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  if (run.model.token_input()) {
    for (auto &t : run.ex.tensor<std::int32_t>(run.plan.inputs())) t = int(rng() % run.model.input.vocab);
  } else {
    std::uniform_real_distribution<float> u(0.f, 1.f);
    std::vector<float> images = run.ex.values(run.plan.inputs());
    for (float &x : images) x = u(rng);
    run.ex.set_values(run.plan.inputs(), images);
  }
  for (auto &l : run.ex.tensor<std::int32_t>(run.plan.labels())) l = int(rng() % run.model.classes());
  run.ex.upload(run.plan.inputs());
  run.ex.upload(run.plan.labels());
}
// The gradient tensors by name, as the kernels left them.
std::map<std::string, std::vector<float>> named_grads(Run &run) {
  run.ex.download(run.plan.grads());
  std::map<std::string, std::vector<float>> out;
  for (const TensorKey &k : grad_tensors(run.plan)) {
    auto g = run.ex.tensor<float>(run.plan.at(k));
    out.emplace(std::string(name_of(k).view()), std::vector<float>(g.begin(), g.end()));
  }
  return out;
}
// The two models the accumulation tests run: the MLP under full recompute, the GPT with dropout
// under selective recompute: between them, backward_saved (stems, heads), backward_recompute and
// backward_selective kernels accumulate.
struct Case {
  const char *what;
  std::unique_ptr<Run> (*make)();
};
const Case accumulation_cases[] = {
    {"mlp full", [] { return std::make_unique<Run>(mlp::model, "mlp", mlp_kernels::table, full, batch); }},
    {"gpt selective", [] { return std::make_unique<Run>(gpt::model, "gpt", gpt_kernels::table, selective, 2, 0.1); }},
};
}  // namespace

// grads(A) with accumulate off, then micro-batch B (other inputs and labels) with accumulate on,
// equals grads(A) + grads(B) with grads(B) computed separately. Tolerance: atol 2e-7 of each
// tensor's scale, rtol 0 (the kernel adds the old gradient to its float32 sum: one rounding, of
// at most 2^-24 = 6e-8 of scale, on top of float32 sums that need not round exactly as in the
// separate run; observed 5.9e-8 for the MLP, 6.0e-8 for the GPT). 2 grads(A) (the
// same micro-batch twice) and grads(B) alone (the old gradients dropped) must both fail it, in
// every tensor.
constexpr Tolerance accumulation_tolerance{2e-7, 0};
BOOST_AUTO_TEST_CASE(gradient_accumulation_adds_micro_batches) {
  for (const Case &c : accumulation_cases) {
    const auto a = c.make();
    a->ex.run(Executor::Phase::train);
    const auto grads_a = named_grads(*a);
    a->scalars.accumulate = true;
    load_other_batch(*a, 11);
    a->ex.run(Executor::Phase::train);
    const auto accumulated = named_grads(*a);
    const auto b = c.make();
    load_other_batch(*b, 11);
    b->ex.run(Executor::Phase::train);
    const auto grads_b = named_grads(*b);
    double worst = 0;
    for (const auto &[name, sum] : accumulated) {
      const std::vector<float> &ga = grads_a.at(name), &gb = grads_b.at(name);
      Rows expected(sum.size()), twice_a(sum.size());
      for (std::size_t i = 0; i < sum.size(); ++i) {
        expected[i] = double(ga[i]) + double(gb[i]);
        twice_a[i] = 2.0 * ga[i];
      }
      const Comparison ok = testing::compare(sum, expected, accumulation_tolerance);
      BOOST_TEST(ok.ok(), c.what << " " << name << ": " << ok.describe());
      worst = std::max(worst, ok.worst_of_scale);
      BOOST_TEST(testing::compare(twice_a, expected, accumulation_tolerance).mismatches > 0u, c.what << " " << name);
      BOOST_TEST(testing::compare(gb, expected, accumulation_tolerance).mismatches > 0u, c.what << " " << name);
    }
    if (testing::show_errors()) BOOST_TEST_MESSAGE(c.what << ": worst accumulation error " << worst << " of scale");
  }
}

// With accumulate off the kernels must not read the old gradients: a grads buffer prefilled
// with NaN ends up with the same gradients, bit for bit, as one that held zeros. Every model of
// the registry, fp32 and bf16 (the tied ones: a table a later stage shares adds to what that
// stage wrote in the same micro-batch, its stage's other gradients must not; gpt2_tiny's
// position table once kept every earlier step's gradient).
BOOST_AUTO_TEST_CASE(gradients_overwrite_the_buffer_without_accumulate) {
  for (const testing::TestModel &z : testing::test_models())
    for (Precision precision : {Precision::fp32, Precision::bf16}) {
      const std::string what = std::string(z.name) + " " + std::string(precision_name(precision));
      auto make = [&] {
        return std::make_unique<Run>(z.model, z.name, z.cpu, none, z.samples[0], 0.0, false, Device::cpu, precision);
      };
      const auto zeros = make();
      zeros->ex.run(Executor::Phase::train);
      const auto expected = named_grads(*zeros);
      const auto nans = make();
      std::ranges::fill(nans->ex.tensor<float>(nans->plan.grads()), std::numeric_limits<float>::quiet_NaN());
      nans->ex.upload(nans->plan.grads());
      nans->ex.run(Executor::Phase::train);
      for (const auto &[name, got] : named_grads(*nans)) {
        BOOST_TEST(std::ranges::all_of(got, [](float x) { return std::isfinite(x); }), what << " " << name);
        BOOST_TEST(same_bits(got, expected.at(name)), what << " " << name);
      }
    }
}

// ---- AdamW ----
// One AdamW step in double, the rule of generators/layers.h (decoupled weight decay):
//   m' = b1 m + (1 - b1) g,  v' = b2 v + (1 - b2) g^2,  p' = p - lr ((m' / bias1) / (sqrt(v' / bias2) + eps) + wd p)
// with bias1 = 1 - b1^t and bias2 = 1 - b2^t as trainer/loop.cpp (Training::step) sets them for step t.
struct AdamW {
  double lr, beta1, beta2, eps, weight_decay, bias1, bias2;
};
struct AdamState {
  Rows p, m, v;
};
AdamState adamw_reference(const AdamW &a, bool decayed, std::span<const float> p, std::span<const float> g,
                          std::span<const float> m, std::span<const float> v) {
  AdamState out{Rows(p.size()), Rows(p.size()), Rows(p.size())};
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double m1 = a.beta1 * m[i] + (1 - a.beta1) * g[i], v1 = a.beta2 * v[i] + (1 - a.beta2) * double(g[i]) * g[i];
    const double step = (m1 / a.bias1) / (std::sqrt(v1 / a.bias2) + a.eps);
    out.p[i] = p[i] - a.lr * (step + (decayed ? a.weight_decay : 0.0) * p[i]);
    out.m[i] = m1;
    out.v[i] = v1;
  }
  return out;
}

// The GPT's linear weights, from the description above: the blocks' p2, p4, p9, p11 and the
// head's p1. These, and only these, are decayed.
bool gpt_linear_weight(const TensorKey &k) {  // the head's linear (s2.b0.p1_w) and the blocks' four (s1.b<i>.p<k>_w)
  if (k.slot != Slot::parameter || k.index != 0) return false;
  if (k.stage == 2) return k.block == 0 && k.layer == 1;
  return k.stage == 1 && (k.layer == 2 || k.layer == 4 || k.layer == 9 || k.layer == 11);
}

// Phase::optimize on the GPT (every kind of parameter: linear weights and biases, LayerNorm
// gains and shifts, token and position embeddings) from a known state at step t = 3, against
// adamw_reference over every parameter tensor: p, m and v. Weight decay applies to the 25 linear
// weights (s1.b<i>.p2_w, p4_w, p9_w, p11_w, s2.b0.p1_w), which the plan places first, and not
// to linear biases, LayerNorm parameters (s*.p1_w/_b, p8_w/_b, s2.b0.p0_w/_b) or the embeddings
// (s0.b0.p0_w, s0.b0.p0_b, which end in _w/_b but are not linear): per tensor, the reference
// with the other decay choice fails, and so do references without either bias correction
// (bias1 = 0.271, bias2 = 0.003 here). Tolerance: atol 3e-7 of each tensor's scale, rtol 0 (a
// few float32 operations per element, each rounded to 2^-24; observed 8.0e-8).
constexpr Tolerance adamw_tolerance{3e-7, 0};
BOOST_AUTO_TEST_CASE(adamw_matches_a_plain_implementation) {
  Run run(gpt::model, "gpt", gpt_kernels::table, none, 2);
  std::vector<const Tensor *> params;
  for (const Tensor &t : run.plan.tensors)
    if (t.role == Role::params && t.key.layer >= 0) params.push_back(&t);
  BOOST_TEST_REQUIRE(params.size() == 2u * (1 + 6 * gpt::n_layer + 2));
  // Known moments and gradients at each parameter's offset (m, v and the gradients share the
  // parameters' layout); v > 0. The parameters are the Run's.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const Plan &plan = run.plan;
  auto flat = [&](TensorId root) { return run.ex.tensor<float>(root); };
  for (const Tensor *t : params)
    for (std::size_t i = t->offset / 4; i < (t->offset + t->bytes()) / 4; ++i) {
      flat(plan.grads())[i] = 0.1f * u(rng);
      flat(plan.adam_m())[i] = 0.01f * u(rng);
      flat(plan.adam_v())[i] = 1e-4f * (1.5f + u(rng));
    }
  for (TensorId root : {plan.params(), plan.grads(), plan.adam_m(), plan.adam_v()}) run.ex.upload(root);
  const std::vector<float> p0 = run.read(plan.params()), g0 = run.read(plan.grads()), m0 = run.read(plan.adam_m()),
                           v0 = run.read(plan.adam_v());
  auto &s = run.scalars;
  s.lr = 1e-2f;
  s.weight_decay = 0.1f;
  const int step = 3;  // bias corrections as the trainer computes them for this step
  s.bias1 = float(1.0 - std::pow(double(s.beta1), double(step)));
  s.bias2 = float(1.0 - std::pow(double(s.beta2), double(step)));
  run.ex.run(Executor::Phase::optimize);
  const std::vector<float> p1 = run.read(plan.params()), m1 = run.read(plan.adam_m()), v1 = run.read(plan.adam_v());

  const AdamW a{s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.bias1, s.bias2};
  AdamW no_bias1 = a, no_bias2 = a;
  no_bias1.bias1 = no_bias2.bias2 = 1;
  int decayed = 0;
  std::size_t decayed_end = 0, plain_begin = SIZE_MAX;
  double worst = 0;
  for (const Tensor *t : params) {
    const std::string name(name_of(t->key).view());
    const bool decay = gpt_linear_weight(t->key);
    decayed += decay;
    if (decay)
      decayed_end = std::max(decayed_end, t->offset + t->bytes());
    else
      plain_begin = std::min(plain_begin, t->offset);
    const std::size_t at = t->offset / 4, n = t->bytes() / 4;
    auto range = [&](const std::vector<float> &v) { return std::span<const float>(v).subspan(at, n); };
    const AdamState want = adamw_reference(a, decay, range(p0), range(g0), range(m0), range(v0));
    for (auto [what, got, ref] : {std::tuple{"p", &p1, &want.p}, {"m", &m1, &want.m}, {"v", &v1, &want.v}}) {
      const Comparison c = testing::compare(range(*got), std::span<const double>(*ref), adamw_tolerance);
      BOOST_TEST(c.ok(), name << " " << what << ": " << c.describe());
      worst = std::max(worst, c.worst_of_scale);
    }
    const AdamState other_decay = adamw_reference(a, !decay, range(p0), range(g0), range(m0), range(v0));
    BOOST_TEST(testing::compare(range(p1), std::span<const double>(other_decay.p), adamw_tolerance).mismatches > 0u,
               name << ": decay " << !decay << " also matches");
    for (const AdamW *wrong : {&no_bias1, &no_bias2}) {
      const AdamState w = adamw_reference(*wrong, decay, range(p0), range(g0), range(m0), range(v0));
      BOOST_TEST(testing::compare(range(p1), std::span<const double>(w.p), adamw_tolerance).mismatches > 0u,
                 name << ": matches without bias correction");
    }
  }
  BOOST_TEST(decayed == 4 * gpt::n_layer + 1);
  BOOST_TEST(decayed_end <= plain_begin);  // the decayed range first
  if (testing::show_errors()) BOOST_TEST_MESSAGE("adamw: worst error " << worst << " of scale");
}

// ---- host conversions ----
// float_to_bf16 and the bf16 inputs written by set_values round to the nearest bf16 value, ties
// to even, and read back widened exactly; a bf16 tensor refuses a float view. Each case is
// {float, its nearest-even bf16 bits}: ties both ways, just above and below a tie, negatives.
BOOST_AUTO_TEST_CASE(bf16_host_conversion_rounds_to_nearest_even) {
  const std::pair<float, std::uint16_t> cases[] = {
      {1.0f, 0x3F80},
      {1.0f + 0x1.0p-8f, 0x3F80},                   // tie: down to even
      {1.0f + 3 * 0x1.0p-8f, 0x3F82},               // tie: up to even
      {1.0f + 0x1.0p-8f + 0x1.0p-20f, 0x3F81},      // just above the tie
      {1.0f + 3 * 0x1.0p-8f - 0x1.0p-20f, 0x3F81},  // just below the tie
      {0.75f + 0x1.0p-9f, 0x3F40},                  // tie in [0.5, 1): down to even
      {0.75f + 3 * 0x1.0p-9f, 0x3F42},              // tie in [0.5, 1): up to even
      {-(1.0f + 0x1.0p-8f), 0xBF80},                // negative ties
      {-(1.0f + 3 * 0x1.0p-8f), 0xBF82},
      {-5.0f, 0xC0A0},
  };
  for (auto [x, bits] : cases) BOOST_TEST(runtime::float_to_bf16(x) == bits, x);
  BOOST_TEST(runtime::bf16_to_float(0xC0A0) == -5.0f);
  BOOST_TEST(runtime::bf16_to_float(0x3F82) == 1.0f + 2 * 0x1.0p-7f);

  Run run(mlp::model, "mlp", mlp_kernels::table, none, batch, 0, false, Device::cpu, Precision::bf16);
  BOOST_TEST(run.ex.element_size(run.plan.inputs()) == 2u);
  BOOST_CHECK_THROW(run.ex.tensor<float>(run.plan.inputs()), std::runtime_error);
  std::vector<float> values = run.ex.values(run.plan.inputs());
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = cases[i % std::size(cases)].first;
  run.ex.set_values(run.plan.inputs(), values);
  const auto raw = run.ex.tensor<std::uint16_t>(run.plan.inputs());
  const std::vector<float> widened = run.ex.values(run.plan.inputs());
  std::size_t wrong_bits = 0, wrong_values = 0;
  for (std::size_t i = 0; i < raw.size(); ++i) {
    const std::uint16_t bits = cases[i % std::size(cases)].second;
    wrong_bits += raw[i] != bits;
    std::uint32_t wide = std::uint32_t(bits) << 16;
    float exact;
    std::memcpy(&exact, &wide, 4);
    wrong_values += widened[i] != exact;
  }
  BOOST_TEST(wrong_bits == 0u);
  BOOST_TEST(wrong_values == 0u);
}

// The planned peak is the real peak only if kernels allocate no temporaries of their own.
BOOST_AUTO_TEST_CASE(kernels_allocate_nothing_of_their_own) {
  Run run(mlp::model, "mlp", mlp_kernels::table, sqrt_n, batch);
  runtime::reset_halide_heap_peak();
  run.ex.run(Executor::Phase::train);
  run.ex.run(Executor::Phase::optimize);
  run.ex.run(Executor::Phase::eval);
  BOOST_TEST(runtime::halide_heap().peak == 0u);
}

// The CPU kernels exist as an AVX-512 and an AVX2 variant; the running CPU picks, unless
// REMAT_CPU_VARIANT=avx2 forces the baseline (ctest runs this file both ways: test_model_gradients
// and test_model_gradients_avx2, so every gradient test above passes on each variant the CPU has).
BOOST_AUTO_TEST_CASE(cpu_kernel_variant_follows_the_cpu_and_the_override) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(cpuinfo, line))
    if (line.starts_with("flags")) {
      flags = line + " ";
      break;
    }
  BOOST_REQUIRE_MESSAGE(!flags.empty(), "no flags line in /proc/cpuinfo");
  bool avx512 = true;  // the Skylake-server set the AVX-512 variant is built for
  for (const char *f : {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
    avx512 = avx512 && flags.find(std::string(" ") + f + " ") != std::string::npos;
  const char *forced = std::getenv("REMAT_CPU_VARIANT");
  const bool avx2_forced = forced && std::string_view(forced) == "avx2";
  BOOST_TEST_MESSAGE("CPU has AVX-512: " << avx512 << ", REMAT_CPU_VARIANT=" << (forced ? forced : "(unset)"));
  BOOST_TEST(runtime::cpu_kernel_variant() == (avx512 && !avx2_forced ? "avx512" : "avx2"));
}
