// The generated float32 kernels of the example models, run through the executor, against a
// plain C++ float64 implementation of the same model (the MLP, and the GPT with dropout); and
// the policies against each other, bit for bit.
//
// Tolerance: float32 rounding (2^-24 relative) accumulates through up to 18 layers with sums of
// up to 1024 terms; a relative error of 1e-4 is typical. Each gradient tensor must agree within
// 2e-3 of its largest reference magnitude: an error in any rule (a missing term, a transposed
// index, a dropout mask from the wrong counters) moves entries by far more than that.
#include <boost/test/unit_test.hpp>

#include "counter_hash_ref.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>
import remat;
import remat.runtime;
import mlp;
import mlp.kernels;
import gpt;
import gpt.kernels;

#include "model_run.h"

using namespace remat;
using remat::runtime::Arena;
using remat::runtime::Device;
using remat::runtime::Executor;
using remat::runtime::Scalars;

namespace {

constexpr int batch = 8;
constexpr double tolerance = 2e-3;

// ---- float64 reference of a remat model ----
using Rows = std::vector<double>;  // [R, width] row-major

struct Reference {
  const Model &m;
  Executor &ex;
  double dropout = 0;
  std::uint64_t seed = 0, step = 0;
  long rows = 0;
  std::vector<std::pair<std::string, Rows>> grads;  // by tensor name

  std::vector<double> param(const std::string &name) {
    auto p = ex.tensor<float>(name);
    return {p.begin(), p.end()};
  }
  // Everything a layer's backward needs.
  struct Saved { Rows in, out; std::vector<double> mean, rstd; std::vector<double> prob; std::vector<std::int32_t> tokens; };
  struct Site { std::string prefix; int k; std::uint64_t rng; };

  std::string name(const Site &s, const char *kind, const char *which) const {
    return s.prefix + kind + std::to_string(s.k) + "_" + which;
  }
  double keep(const Site &s, std::uint64_t element) const {  // 0 or 1 / (1 - p), as the kernels
    if (dropout == 0) return 1;
    const double scale = double(float(1.0 / (1.0 - dropout)));
    return testing::keep_ref(seed, step, s.rng + s.k, element, dropout) ? scale : 0.0;
  }

  // Causal softmax of row b's scaled scores for head h over positions 0..t (x is [R, 3C] qkv).
  static std::vector<double> softmax_row(const Rows &x, long b, int h, const Layer &l) {
    const int C = l.out, D = C / l.heads, T = l.block_size;
    const long n = b / T, t = b % T;
    std::vector<double> p(t + 1);
    double mx = -INFINITY, z = 0;
    for (long j = 0; j <= t; ++j) {
      double d = 0;
      for (int e = 0; e < D; ++e) d += x[b * 3 * C + h * D + e] * x[(n * T + j) * 3 * C + C + h * D + e];
      p[j] = d / std::sqrt(double(D));
      mx = std::max(mx, p[j]);
    }
    for (long j = 0; j <= t; ++j) z += std::exp(p[j] - mx);
    for (long j = 0; j <= t; ++j) p[j] = std::exp(p[j] - mx) / z;
    return p;
  }

  Rows layer_forward(const Layer &l, const Site &site, const Rows &x, Saved &s) {
    const long R = rows;
    const int I = l.in, O = l.out;
    Rows y(std::size_t(R) * O);
    s.in = x;
    switch (l.op) {
    case Op::linear: {
      auto w = param(name(site, "p", "w")), bias = param(name(site, "p", "b"));
      for (long b = 0; b < R; ++b)
        for (int o = 0; o < O; ++o) {
          double acc = bias[o];
          for (int i = 0; i < I; ++i) acc += x[b * I + i] * w[i * O + o];
          y[b * O + o] = acc;
        }
      break;
    }
    case Op::layer_norm: {
      auto g = param(name(site, "p", "w")), be = param(name(site, "p", "b"));
      for (long b = 0; b < R; ++b) {
        double mean = 0, var = 0;
        for (int i = 0; i < I; ++i) mean += x[b * I + i] / I;
        for (int i = 0; i < I; ++i) var += (x[b * I + i] - mean) * (x[b * I + i] - mean) / I;
        const double rstd = 1 / std::sqrt(var + 1e-5);
        s.mean.push_back(mean);
        s.rstd.push_back(rstd);
        for (int i = 0; i < I; ++i) y[b * I + i] = (x[b * I + i] - mean) * rstd * g[i] + be[i];
      }
      break;
    }
    case Op::embedding: {
      auto wte = param(name(site, "p", "w")), wpe = param(name(site, "p", "b"));
      auto tokens = ex.tensor<std::int32_t>("inputs");
      s.tokens.assign(tokens.begin(), tokens.end());
      for (long b = 0; b < R; ++b)
        for (int c = 0; c < O; ++c) y[b * O + c] = wte[s.tokens[b] * O + c] + wpe[(b % l.block_size) * O + c];
      break;
    }
    case Op::dropout:
      for (long b = 0; b < R; ++b)
        for (int c = 0; c < O; ++c) y[b * O + c] = x[b * O + c] * keep(site, std::uint64_t(c) + std::uint64_t(O) * b);
      break;
    case Op::attention: {  // P = softmax of scaled causal scores; out = drop(P) v
      const int C = O, H = l.heads, D = C / H, T = l.block_size;
      s.prob.assign(std::size_t(R) * H * T, 0.0);
      for (long b = 0; b < R; ++b)
        for (int h = 0; h < H; ++h) {
          const long n = b / T, t = b % T;
          const std::vector<double> p = softmax_row(x, b, h, l);
          for (long j = 0; j <= t; ++j) {
            const std::uint64_t element = ((std::uint64_t(n) * H + h) * T + t) * T + j;
            s.prob[(b * H + h) * T + j] = p[j] * keep(site, element);
          }
          for (int e = 0; e < D; ++e) {
            double acc = 0;
            for (long j = 0; j <= t; ++j) acc += s.prob[(b * H + h) * T + j] * x[(n * T + j) * 3 * C + 2 * C + h * D + e];
            y[b * C + h * D + e] = acc;
          }
        }
      break;
    }
    default:
      for (std::size_t e = 0; e < y.size(); ++e) {
        const double a = x[e];
        y[e] = l.op == Op::relu ? std::max(a, 0.0)
                                : 0.5 * a * (1 + std::tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)));
      }
    }
    s.out = y;
    return y;
  }

  Rows layer_backward(const Layer &l, const Site &site, const Saved &s, const Rows &dy) {
    const long R = rows;
    const int I = l.in, O = l.out;
    const Rows &x = s.in;
    Rows dx(std::size_t(R) * I, 0.0);
    const std::string gw = name(site, "g", "w"), gb = name(site, "g", "b");
    switch (l.op) {
    case Op::linear: {
      auto w = param(name(site, "p", "w"));
      Rows dw(std::size_t(I) * O, 0.0), db(O, 0.0);
      for (long b = 0; b < R; ++b)
        for (int o = 0; o < O; ++o) {
          db[o] += dy[b * O + o];
          for (int i = 0; i < I; ++i) {
            dw[i * O + o] += x[b * I + i] * dy[b * O + o];
            dx[b * I + i] += dy[b * O + o] * w[i * O + o];
          }
        }
      grads.push_back({gw, dw});
      grads.push_back({gb, db});
      break;
    }
    case Op::layer_norm: {
      auto g = param(name(site, "p", "w"));
      Rows dg(I, 0.0), dbeta(I, 0.0);
      for (long b = 0; b < R; ++b) {
        double s1 = 0, s2 = 0;
        for (int i = 0; i < I; ++i) {
          const double u = (x[b * I + i] - s.mean[b]) * s.rstd[b], du = dy[b * I + i] * g[i];
          s1 += du;
          s2 += du * u;
          dg[i] += dy[b * I + i] * u;
          dbeta[i] += dy[b * I + i];
        }
        for (int i = 0; i < I; ++i) {
          const double u = (x[b * I + i] - s.mean[b]) * s.rstd[b];
          dx[b * I + i] = s.rstd[b] * (dy[b * I + i] * g[i] - s1 / I - u * s2 / I);
        }
      }
      grads.push_back({gw, dg});
      grads.push_back({gb, dbeta});
      break;
    }
    case Op::embedding: {
      Rows dwte(std::size_t(l.vocab) * O, 0.0), dwpe(std::size_t(l.block_size) * O, 0.0);
      for (long b = 0; b < R; ++b)
        for (int c = 0; c < O; ++c) {
          dwte[s.tokens[b] * O + c] += dy[b * O + c];
          dwpe[(b % l.block_size) * O + c] += dy[b * O + c];
        }
      grads.push_back({gw, dwte});
      grads.push_back({gb, dwpe});
      break;
    }
    case Op::dropout:
      for (long b = 0; b < R; ++b)
        for (int c = 0; c < O; ++c) dx[b * O + c] = dy[b * O + c] * keep(site, std::uint64_t(c) + std::uint64_t(O) * b);
      break;
    case Op::attention: {  // textbook softmax Jacobian on the undropped probabilities
      const int C = O, H = l.heads, D = C / H, T = l.block_size;
      for (long b = 0; b < R; ++b)
        for (int h = 0; h < H; ++h) {
          const long n = b / T, t = b % T;
          std::vector<double> p, kp(t + 1), dp(t + 1);
          double dot = 0;
          for (long j = 0; j <= t; ++j) {
            const std::uint64_t element = ((std::uint64_t(n) * H + h) * T + t) * T + j;
            const double k = keep(site, element);
            kp[j] = s.prob[(b * H + h) * T + j];
            double g = 0;
            for (int e = 0; e < D; ++e) g += dy[b * C + h * D + e] * x[(n * T + j) * 3 * C + 2 * C + h * D + e];
            dp[j] = g * k;
            for (int e = 0; e < D; ++e) dx[(n * T + j) * 3 * C + 2 * C + h * D + e] += kp[j] * dy[b * C + h * D + e];
          }
          p = softmax_row(x, b, h, l);  // the undropped probabilities
          for (long j = 0; j <= t; ++j) dot += p[j] * dp[j];
          for (long j = 0; j <= t; ++j) {
            const double ds = p[j] * (dp[j] - dot) / std::sqrt(double(D));
            for (int e = 0; e < D; ++e) {
              dx[b * 3 * C + h * D + e] += ds * x[(n * T + j) * 3 * C + C + h * D + e];
              dx[(n * T + j) * 3 * C + C + h * D + e] += ds * x[b * 3 * C + h * D + e];
            }
          }
        }
      break;
    }
    default:
      for (std::size_t e = 0; e < dx.size(); ++e) {
        const double a = x[e];
        if (l.op == Op::relu) {
          dx[e] = a > 0 ? dy[e] : 0;
        } else {
          const double k0 = 0.7978845608028654, k1 = 0.044715, t = std::tanh(k0 * (a + k1 * a * a * a));
          dx[e] = dy[e] * (0.5 * (1 + t) + 0.5 * a * (1 - t * t) * k0 * (1 + 3 * k1 * a * a));
        }
      }
    }
    return dx;
  }

  // Runs forward, loss and backward; returns the mean loss.
  double run() {
    Rows x;
    if (!m.token_input()) {
      const std::vector<float> images = ex.values("inputs");  // fp32, or bf16 widened
      x.assign(images.begin(), images.end());
    }
    auto labels = ex.tensor<std::int32_t>("labels");
    struct Unit { const Block *blk; std::string prefix; std::uint64_t rng; Rows input; std::vector<Rows> out; std::vector<Saved> saved; };
    std::vector<Unit> units;
    for (int s = 0; s < m.n_stages; ++s)
      for (int b = 0; b < m.stages[s].repeat; ++b) {
        Unit u{&m.stages[s], "s" + std::to_string(s) + ".b" + std::to_string(b) + ".", units.size() * 64, x, {}, {}};
        const Block &blk = *u.blk;
        auto value = [&](int j) -> const Rows & { return j < 0 ? u.input : u.out[j]; };
        for (int k = 0; k < blk.n_layers; ++k) {
          u.saved.emplace_back();
          const Layer &l = blk.layers[k];
          if (l.op == Op::residual_begin) {
            u.out.push_back(value(blk.source(k)));
          } else if (l.op == Op::residual_end) {
            Rows sum = value(blk.source(k));
            const Rows &skip = value(blk.skip_source(k));
            for (std::size_t e = 0; e < sum.size(); ++e) sum[e] += skip[e];
            u.out.push_back(sum);
          } else {
            u.out.push_back(layer_forward(l, {u.prefix, k, u.rng}, value(blk.source(k)), u.saved.back()));
          }
        }
        x = u.out.back();
        units.push_back(std::move(u));
      }
    const int K = m.classes();
    double loss = 0;
    Rows d(x.size());
    for (long b = 0; b < rows; ++b) {
      double mx = x[b * K], z = 0;
      for (int k = 0; k < K; ++k) mx = std::max(mx, x[b * K + k]);
      for (int k = 0; k < K; ++k) z += std::exp(x[b * K + k] - mx);
      loss += (mx + std::log(z) - x[b * K + labels[b]]) / rows;
      for (int k = 0; k < K; ++k) d[b * K + k] = (std::exp(x[b * K + k] - mx) / z - (k == labels[b])) / rows;
    }
    for (auto u = units.rbegin(); u != units.rend(); ++u) {
      const Block &blk = *u->blk;
      std::map<int, Rows> grad;  // by layer output; -1 is the block input
      auto add = [&](int j, const Rows &g) {
        auto [it, fresh] = grad.try_emplace(j, g);
        if (!fresh)
          for (std::size_t e = 0; e < g.size(); ++e) it->second[e] += g[e];
      };
      add(blk.n_layers - 1, d);
      for (int k = blk.n_layers - 1; k >= 0; --k) {
        const Layer &l = blk.layers[k];
        if (!grad.count(k)) continue;
        const Rows g = grad.at(k);
        if (l.op == Op::residual_begin) add(blk.source(k), g);
        else if (l.op == Op::residual_end) {
          add(blk.source(k), g);
          add(blk.skip_source(k), g);
        } else {
          add(blk.source(k), layer_backward(l, {u->prefix, k, u->rng}, u->saved[k], g));
        }
      }
      d = grad.count(-1) ? grad.at(-1) : Rows{};
    }
    return loss;
  }
};

// Kernels against the reference: the loss (within loss_tolerance, relative) and every parameter
// gradient (within grad_tolerance of its largest reference magnitude).
void check_against_reference(Run &run, double dropout, std::size_t expected_grads, double loss_tolerance = 1e-5,
                             double grad_tolerance = tolerance) {
  run.ex.run(Executor::Phase::train);
  Reference ref{run.model, run.ex, dropout, run.scalars.seed, std::uint64_t(run.scalars.step), run.plan.rows, {}};
  const double loss = ref.run();
  double kernel_loss = 0;
  for (float l : run.ex.tensor<float>("row_loss")) kernel_loss += l / double(run.plan.rows);
  BOOST_TEST(std::abs(kernel_loss - loss) <= loss_tolerance * std::abs(loss), "loss " << kernel_loss << " vs " << loss);
  BOOST_TEST(ref.grads.size() == expected_grads);
  for (const auto &[name, g] : ref.grads) {
    auto got = run.ex.tensor<float>(name);
    BOOST_TEST_REQUIRE(got.size() == g.size());
    double scale = 0, worst = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      scale = std::max(scale, std::abs(g[i]));
      worst = std::max(worst, std::abs(g[i] - got[i]));
    }
    BOOST_TEST(worst <= grad_tolerance * scale, name << ": max error " << worst << " of scale " << scale);
    if (std::getenv("REMAT_SHOW_ERRORS")) BOOST_TEST_MESSAGE(name << ": max error " << worst / scale << " of scale");
  }
}

}  // namespace

BOOST_AUTO_TEST_CASE(kernels_match_the_float64_reference) {
  Run run(mlp::model, "mlp", mlp_kernels::table, none, batch);
  check_against_reference(run, 0, 2u * (1 + 3 * 16 + 2));
}

// The GPT at two sequences with dropout 0.1: attention, embedding and the dropout masks (from
// the same counters as the kernels) against the reference, under selective recompute.
BOOST_AUTO_TEST_CASE(gpt_kernels_match_the_float64_reference) {
  for (Policy p : {none, selective}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1);
    check_against_reference(run, 0.1, 2u * (1 + 6 * 6 + 2));
  }
}

// bf16 kernels against the same float64 reference. Each layer output and each activation
// gradient is rounded to bf16 (relative error up to 2^-9 = 2e-3 each), GEMM operands included,
// and the rounding errors of up to 18 layers add up: each gradient tensor must agree within 5e-2
// of its largest magnitude and the loss within 1e-2. Any mistake in the bf16 plumbing (a tensor
// read with the wrong element type, a missing widening) gives garbage far beyond that; the rules
// themselves are pinned by the float32 tests above.
BOOST_AUTO_TEST_CASE(bf16_kernels_match_the_float64_reference) {
  Run mlp_run(mlp::model, "mlp", mlp_kernels::table, none, batch, 0, true, Device::cpu, Precision::bf16);
  check_against_reference(mlp_run, 0, 2u * (1 + 3 * 16 + 2), 1e-2, 5e-2);
  for (Policy p : {none, full}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true, Device::cpu, Precision::bf16);
    check_against_reference(run, 0.1, 2u * (1 + 6 * 6 + 2), 1e-2, 5e-2);
  }
}

// bf16 rounding happens where each value is defined, so a recompute rounds exactly as the
// first computation did: every policy (and offload) gives the same bf16-run gradients, bit for bit.
BOOST_AUTO_TEST_CASE(bf16_policies_give_bit_identical_gradients) {
  Run base(gpt::model, "gpt", gpt_kernels::table, none, 2, 0.1, true, Device::cpu, Precision::bf16);
  base.ex.run(Executor::Phase::train);
  const std::vector<float> expected = base.grads();
  for (Policy p : {selective, full, Policy{Policy::Kind::every_n_layers, 2}, sqrt_n, with_offload(full),
                   with_offload(sqrt_n)}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true, Device::cpu, Precision::bf16);
    run.ex.run(Executor::Phase::train);
    const std::vector<float> got = run.grads();
    BOOST_TEST(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0,
               "bf16 gradients differ under " << policy_name(p).view());
  }
  Run mlp_base(mlp::model, "mlp", mlp_kernels::table, none, batch, 0, true, Device::cpu, Precision::bf16);
  mlp_base.ex.run(Executor::Phase::train);
  const std::vector<float> mlp_expected = mlp_base.grads();
  for (Policy p : {full, sqrt_n, with_offload(Policy{Policy::Kind::every_n_layers, 2})}) {
    Run run(mlp::model, "mlp", mlp_kernels::table, p, batch, 0, true, Device::cpu, Precision::bf16);
    run.ex.run(Executor::Phase::train);
    const std::vector<float> got = run.grads();
    BOOST_TEST(std::memcmp(got.data(), mlp_expected.data(), got.size() * sizeof(float)) == 0,
               "mlp bf16 gradients differ under " << policy_name(p).view());
  }
}

// Host conversions agree with the kernels' rounding: the bf16 inputs written by set_values read
// back as the nearest bf16 values (ties to even), and a bf16 tensor refuses a float view.
BOOST_AUTO_TEST_CASE(bf16_host_conversion_rounds_to_nearest_even) {
  BOOST_TEST(runtime::float_to_bf16(1.0f) == 0x3F80);
  BOOST_TEST(runtime::float_to_bf16(1.0f + 0x1.0p-8f) == 0x3F80);             // tie: to even
  BOOST_TEST(runtime::float_to_bf16(1.0f + 3 * 0x1.0p-8f) == 0x3F82);         // tie: to even (up)
  BOOST_TEST(runtime::float_to_bf16(1.0f + 0x1.0p-8f + 0x1.0p-20f) == 0x3F81);  // above the tie
  BOOST_TEST(runtime::bf16_to_float(0xC0A0) == -5.0f);
  Run run(mlp::model, "mlp", mlp_kernels::table, none, batch, 0, false, Device::cpu, Precision::bf16);
  BOOST_TEST(run.ex.element_size("inputs") == 2u);
  BOOST_CHECK_THROW(run.ex.tensor<float>("inputs"), std::runtime_error);
  for (float x : run.ex.values("inputs")) BOOST_TEST(runtime::bf16_to_float(runtime::float_to_bf16(x)) == x);
}

BOOST_AUTO_TEST_CASE(policies_give_bit_identical_gradients) {
  Run base(mlp::model, "mlp", mlp_kernels::table, none, batch);
  base.ex.run(Executor::Phase::train);
  const std::vector<float> expected = base.grads();
  for (Policy p : {full, Policy{Policy::Kind::every_n_layers, 2}, Policy{Policy::Kind::every_n_layers, 5}, sqrt_n,
                   with_offload(full), with_offload(Policy{Policy::Kind::every_n_layers, 2}), with_offload(sqrt_n)}) {
    Run run(mlp::model, "mlp", mlp_kernels::table, p, batch);
    run.ex.run(Executor::Phase::train);
    const std::vector<float> got = run.grads();
    BOOST_TEST(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0,
               "gradients differ under " << policy_name(p).view());
  }
}

// Offload plans on the CPU executor (plain copies to the host buffer and back): the restored
// checkpoints feed the recompute exactly. With dropout, so the masks are keyed as without.
BOOST_AUTO_TEST_CASE(gpt_offload_gives_bit_identical_gradients) {
  Run base(gpt::model, "gpt", gpt_kernels::table, none, 2, 0.1);
  base.ex.run(Executor::Phase::train);
  const std::vector<float> expected = base.grads();
  for (Policy p : {with_offload(full), with_offload(Policy{Policy::Kind::every_n_layers, 2}), with_offload(sqrt_n)}) {
    Run run(gpt::model, "gpt", gpt_kernels::table, p, 2, 0.1, true);
    BOOST_TEST(run.plan.offload_bytes > 0u);
    run.ex.run(Executor::Phase::train);
    const std::vector<float> got = run.grads();
    BOOST_TEST(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)) == 0,
               "gradients differ under " << policy_name(p).view());
  }
}

BOOST_AUTO_TEST_CASE(gradient_accumulation_adds_micro_batches) {
  Run run(mlp::model, "mlp", mlp_kernels::table, full, batch);
  run.ex.run(Executor::Phase::train);
  const std::vector<float> once = run.grads();
  run.scalars.accumulate = true;
  run.ex.run(Executor::Phase::train);  // the same micro-batch again: exactly twice the gradient
  const std::vector<float> twice = run.grads();
  bool exact = true;
  for (std::size_t i = 0; i < once.size(); ++i) exact = exact && twice[i] == 2 * once[i];
  BOOST_TEST(exact);
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
