// Halide algorithms for every layer: forward Funcs and hand-written vector-Jacobian rules.
// Element type is a parameter: float32 for the generated kernels, float64 in the gradient tests.
// Activations may be stored as bf16: a layer's output is then rounded where it is defined
// (`store`) and readers widen it back; gradient terms stay in the element type until the model
// compiler sums and stores them.
//
// Layout: a [B, C] activation is a Func f(c, b) with c the contiguous feature index and b the
// row. A linear weight is w(o, k) ([K, O] row-major, y = x w + b).
#pragma once

#include <Halide.h>

#include <functional>
#include <string>

namespace remat::gen {

struct Vars {
  Halide::Var c{"c"}, b{"b"};
};

// bf16 as its bit pattern in a UInt(16): float32 rounded to nearest even (NaN stays NaN), and
// back. Plain integer arithmetic, so every target (CPU, CUDA, OpenCL) rounds the same way and
// none needs bf16 support of its own.
inline Halide::Expr to_bf16_bits(Halide::Expr x) {
  using namespace Halide;
  Expr bits = reinterpret(UInt(32), cast(Float(32), x));
  Expr rounded = cast(UInt(16), (bits + (Expr(uint32_t{0x7fff}) + ((bits >> 16) & Expr(uint32_t{1})))) >> 16);
  return select(is_nan(x), Expr(uint16_t{0x7fc0}), rounded);
}
inline Halide::Expr from_bf16_bits(Halide::Expr h) {
  using namespace Halide;
  return reinterpret(Float(32), cast(UInt(32), h) << 16);
}

// out(c, b) = sum_k a(k, b) * w(c, k): a [M, K] and w [K, N] row-major, out [M, N].
struct MatMul {
  Halide::Func out;  // the caller may redefine it with an epilogue through `sum`
  Halide::Func acc;  // the accumulator (scheduled at register tiles of `out`)
  Halide::RDom k;
};

class Layers {
public:
  Layers(Halide::Type type, const Vars &v, bool bf16 = false) : t(type), bf16(bf16), v(v) {}

  Halide::Expr constant(double x) const { return Halide::Internal::make_const(t, x); }
  // A stored activation: itself, or its bf16 bits.
  Halide::Expr store(Halide::Expr e) const { return bf16 ? to_bf16_bits(e) : e; }

  using Epilogue = std::function<Halide::Expr(Halide::Expr sum)>;
  MatMul matmul(const std::string &name, Halide::Func a, Halide::Func w, Halide::Expr inner,
                const Epilogue &epilogue = {}) const {
    using namespace Halide;
    MatMul m{Func(name), Func(name + "_acc"), RDom(0, inner, name + "_k")};
    m.acc(v.c, v.b) = constant(0);
    m.acc(v.c, v.b) += a(m.k, v.b) * w(v.c, m.k);
    m.out(v.c, v.b) = epilogue ? epilogue(m.acc(v.c, v.b)) : Expr(m.acc(v.c, v.b));
    return m;
  }

  // ---- Linear: y = x w + bias -------------------------------------------------------------
  MatMul linear(const std::string &name, Halide::Func x, Halide::Func w, Halide::Func bias, int in) const {
    return matmul(name, x, w, in, [&](Halide::Expr sum) { return sum + bias(v.c); });
  }
  // dW(o, k) = sum_b x(k, b) dy(o, b); rows of the product are input features k.
  MatMul linear_weight_grad(const std::string &name, Halide::Func x, Halide::Func dy, Halide::Expr batch,
                            const Epilogue &epilogue = {}) const {
    Halide::Func xt(name + "_xt");
    xt(v.c, v.b) = x(v.b, v.c);  // xt(b, k) = x(k, b): the operand's row index is k
    return matmul(name, xt, dy, batch, epilogue);
  }
  Halide::Func transpose(const std::string &name, Halide::Func w) const {
    Halide::Func wt(name);
    wt(v.c, v.b) = store(w(v.b, v.c));
    return wt;
  }
  // dx(k, b) = sum_o dy(o, b) wt(k, o)
  MatMul linear_input_grad(const std::string &name, Halide::Func dy, Halide::Func wt, int out) const {
    return matmul(name, dy, wt, out);
  }
  // column sum over rows: db(o) = sum_b dy(o, b)
  Halide::Func column_sum(const std::string &name, Halide::Func f, Halide::Expr batch) const {
    Halide::Func s(name);
    Halide::RDom r(0, batch, name + "_r");
    s(v.c) = constant(0);
    s(v.c) += f(v.c, r);
    return s;
  }

  // ---- LayerNorm over the C features of each row -------------------------------------------
  static constexpr double layer_norm_eps = 1e-5;
  // Row statistics: mean(b) and rstd(b) = 1 / sqrt(var(b) + eps); sum and sq are the row sums
  // they are made from (undefined when the statistics are read from saved buffers).
  struct LayerNormStats {
    Halide::Func mean, rstd, sum, sq;
  };
  LayerNormStats layer_norm_stats(const std::string &mean_name, const std::string &rstd_name, Halide::Func x,
                                  int width) const {
    using namespace Halide;
    LayerNormStats s{Func(mean_name), Func(rstd_name), Func(mean_name + "_sum"), Func(rstd_name + "_sq")};
    RDom r(0, width, mean_name + "_r");
    s.sum(v.b) = constant(0);
    s.sum(v.b) += x(r, v.b);
    s.mean(v.b) = s.sum(v.b) / constant(width);
    s.sq(v.b) = constant(0);
    s.sq(v.b) += (x(r, v.b) - s.mean(v.b)) * (x(r, v.b) - s.mean(v.b));
    s.rstd(v.b) = constant(1) / sqrt(s.sq(v.b) / constant(width) + constant(layer_norm_eps));
    return s;
  }
  Halide::Expr normalized(Halide::Func x, const LayerNormStats &s, Halide::Expr c, Halide::Expr b) const {
    return (x(c, b) - s.mean(b)) * s.rstd(b);
  }
  Halide::Func layer_norm(const std::string &name, Halide::Func x, const LayerNormStats &s, Halide::Func gamma,
                          Halide::Func beta) const {
    Halide::Func y(name);
    y(v.c, v.b) = store(normalized(x, s, v.c, v.b) * gamma(v.c) + beta(v.c));
    return y;
  }
  // du = dy * gamma; dx = rstd * (du - s1 / C - u * s2 / C) with u the normalized input and the
  // row sums s1 = sum_c du, s2 = sum_c du * u; dgamma = sum_b dy * u, dbeta = sum_b dy.
  struct LayerNormGrad {
    Halide::Func s1, s2, dx, dgamma, dbeta;
  };
  LayerNormGrad layer_norm_grad(const std::string &s1_name, const std::string &s2_name, const std::string &dx_name,
                                Halide::Func x, const LayerNormStats &s, Halide::Func gamma, Halide::Func dy, int width,
                                Halide::Expr batch) const {
    using namespace Halide;
    LayerNormGrad g{Func(s1_name), Func(s2_name), Func(dx_name), Func(dx_name + "_dgamma"), Func(dx_name + "_dbeta")};
    auto u = [&](Expr c, Expr b) { return normalized(x, s, c, b); };
    auto du = [&](Expr c, Expr b) { return dy(c, b) * gamma(c); };
    RDom r(0, width, s1_name + "_r");
    g.s1(v.b) = constant(0);
    g.s1(v.b) += du(r, v.b);
    g.s2(v.b) = constant(0);
    g.s2(v.b) += du(r, v.b) * u(r, v.b);
    g.dx(v.c, v.b) =
        s.rstd(v.b) * (du(v.c, v.b) - g.s1(v.b) / constant(width) - u(v.c, v.b) * g.s2(v.b) / constant(width));
    RDom rb(0, batch, dx_name + "_rb");
    g.dgamma(v.c) = constant(0);
    g.dgamma(v.c) += dy(v.c, rb) * u(v.c, rb);
    g.dbeta(v.c) = constant(0);
    g.dbeta(v.c) += dy(v.c, rb);
    return g;
  }

  // ---- RMSNorm over the C features of each row (Llama): y = x * rstd * gamma ------------------
  static constexpr double rms_norm_eps = 1e-6;
  // rstd(b) = 1 / sqrt(mean_c x^2 + eps); sq is the row sum it is made from (undefined when rstd
  // is read from a saved buffer).
  struct RmsNormStats {
    Halide::Func rstd, sq;
  };
  RmsNormStats rms_norm_stats(const std::string &rstd_name, Halide::Func x, int width) const {
    using namespace Halide;
    RmsNormStats s{Func(rstd_name), Func(rstd_name + "_sq")};
    RDom r(0, width, rstd_name + "_r");
    s.sq(v.b) = constant(0);
    s.sq(v.b) += x(r, v.b) * x(r, v.b);
    s.rstd(v.b) = constant(1) / sqrt(s.sq(v.b) / constant(width) + constant(rms_norm_eps));
    return s;
  }
  Halide::Func rms_norm(const std::string &name, Halide::Func x, Halide::Func rstd, Halide::Func gamma) const {
    Halide::Func y(name);
    y(v.c, v.b) = store(x(v.c, v.b) * rstd(v.b) * gamma(v.c));
    return y;
  }
  // du = dy * gamma, u = x * rstd; dx = rstd * (du - u * s / C) with the row sum s = sum_c du * u;
  // dgamma = sum_b dy * u.
  struct RmsNormGrad {
    Halide::Func s, dx, dgamma;
  };
  RmsNormGrad rms_norm_grad(const std::string &s_name, const std::string &dx_name, Halide::Func x, Halide::Func rstd,
                            Halide::Func gamma, Halide::Func dy, int width, Halide::Expr batch) const {
    using namespace Halide;
    RmsNormGrad g{Func(s_name), Func(dx_name), Func(dx_name + "_dgamma")};
    auto u = [&](Expr c, Expr b) { return x(c, b) * rstd(b); };
    auto du = [&](Expr c, Expr b) { return dy(c, b) * gamma(c); };
    RDom r(0, width, s_name + "_r");
    g.s(v.b) = constant(0);
    g.s(v.b) += du(r, v.b) * u(r, v.b);
    g.dx(v.c, v.b) = rstd(v.b) * (du(v.c, v.b) - u(v.c, v.b) * g.s(v.b) / constant(width));
    RDom rb(0, batch, dx_name + "_rb");
    g.dgamma(v.c) = constant(0);
    g.dgamma(v.c) += dy(v.c, rb) * u(v.c, rb);
    return g;
  }

  // ---- SwiGLU (gated MLP): [a | b] of 2H features in, silu(a) * b out (H) -------------------
  Halide::Expr sigmoid(Halide::Expr z) const { return constant(1) / (constant(1) + Halide::exp(-z)); }
  Halide::Func swiglu(const std::string &name, Halide::Func x, int out) const {
    Halide::Func y(name);
    Halide::Expr a = x(v.c, v.b), b = x(v.c + out, v.b);
    y(v.c, v.b) = store(a * sigmoid(a) * b);
    return y;
  }
  // d/da = dy * b * sig(a) * (1 + a * (1 - sig(a))), d/db = dy * silu(a): the gradient of the
  // 2H-wide input, the gate's half first.
  Halide::Func swiglu_grad(const std::string &name, Halide::Func x, Halide::Func dy, int out) const {
    using namespace Halide;
    Func dx(name);
    Expr c = v.c % out;  // the feature within its half
    Expr a = x(c, v.b), b = x(c + out, v.b), g = dy(c, v.b), sa = sigmoid(a);
    dx(v.c, v.b) = select(v.c < out, g * b * sa * (constant(1) + a * (constant(1) - sa)), g * a * sa);
    return dx;
  }

  // ---- GELU (tanh form, as GPT-2) and ReLU ---------------------------------------------------
  // tanh(z) = 1 - 2 / (exp(2z) + 1): finite for every z and vectorizes through Halide's exp.
  Halide::Expr tanh_via_exp(Halide::Expr z) const {
    return constant(1) - constant(2) / (Halide::exp(constant(2) * z) + constant(1));
  }
  static constexpr double gelu_k0 = 0.7978845608028654;  // sqrt(2 / pi)
  static constexpr double gelu_k1 = 0.044715;
  Halide::Func gelu(const std::string &name, Halide::Func x) const {
    using namespace Halide;
    Func y(name);
    Expr a = x(v.c, v.b);
    y(v.c, v.b) = store(constant(0.5) * a *
                        (constant(1) + tanh_via_exp(constant(gelu_k0) * (a + constant(gelu_k1) * a * a * a))));
    return y;
  }
  Halide::Func gelu_grad(const std::string &name, Halide::Func x, Halide::Func dy) const {
    using namespace Halide;
    Func dx(name);
    Expr a = x(v.c, v.b);
    Expr th = tanh_via_exp(constant(gelu_k0) * (a + constant(gelu_k1) * a * a * a));
    Expr slope = constant(0.5) * (constant(1) + th) + constant(0.5) * a * (constant(1) - th * th) * constant(gelu_k0) *
                                                          (constant(1) + constant(3 * gelu_k1) * a * a);
    dx(v.c, v.b) = dy(v.c, v.b) * slope;
    return dx;
  }
  Halide::Func relu(const std::string &name, Halide::Func x) const {
    Halide::Func y(name);
    y(v.c, v.b) = store(Halide::max(x(v.c, v.b), constant(0)));
    return y;
  }
  Halide::Func relu_grad(const std::string &name, Halide::Func x, Halide::Func dy) const {
    Halide::Func dx(name);
    dx(v.c, v.b) = Halide::select(x(v.c, v.b) > constant(0), dy(v.c, v.b), constant(0));
    return dx;
  }

  // ---- Softmax cross-entropy -----------------------------------------------------------------
  struct CrossEntropy {
    Halide::Func row_loss, row_correct, dlogits, row_max, row_lse, sum_exp;
  };
  // row_loss(b) = logsumexp(logits(., b)) - logits(label, b); dlogits = (softmax - onehot) * scale
  CrossEntropy cross_entropy(Halide::Func logits, Halide::Func labels, int classes, Halide::Expr scale) const {
    using namespace Halide;
    CrossEntropy ce{Func("row_loss"), Func("row_correct"), Func("dlogits"),
                    Func("row_max"),  Func("row_lse"),     Func("sum_exp")};
    RDom r(0, classes, "ce_r");
    ce.row_max(v.b) = logits(0, v.b);
    ce.row_max(v.b) = max(ce.row_max(v.b), logits(r, v.b));
    ce.sum_exp(v.b) = constant(0);
    ce.sum_exp(v.b) += exp(logits(r, v.b) - ce.row_max(v.b));
    ce.row_lse(v.b) = ce.row_max(v.b) + log(ce.sum_exp(v.b));
    Expr label = clamp(labels(v.b), 0, classes - 1);
    ce.row_loss(v.b) = ce.row_lse(v.b) - logits(label, v.b);
    // correct when the label's logit is the row maximum (ties count as correct)
    ce.row_correct(v.b) = select(logits(label, v.b) >= ce.row_max(v.b), 1, 0);
    Expr p = exp(logits(v.c, v.b) - ce.row_lse(v.b));
    ce.dlogits(v.c, v.b) = store((p - select(v.c == label, constant(1), constant(0))) * scale);
    return ce;
  }

  // ---- AdamW (decoupled weight decay), one element at a time --------------------------------
  // Returns {p, m, v} updated; a Tuple so that in-place use reads every input before writing.
  Halide::Func adamw(Halide::Func p, Halide::Func g, Halide::Func m, Halide::Func var, Halide::Expr lr,
                     Halide::Expr beta1, Halide::Expr beta2, Halide::Expr eps, Halide::Expr weight_decay,
                     Halide::Expr bias1, Halide::Expr bias2) const {
    using namespace Halide;
    Func upd("adamw");
    Expr m1 = beta1 * m(v.c) + (constant(1) - beta1) * g(v.c);
    Expr v1 = beta2 * var(v.c) + (constant(1) - beta2) * g(v.c) * g(v.c);
    Expr step = (m1 / bias1) / (sqrt(v1 / bias2) + eps);
    Expr p1 = p(v.c) - lr * (step + weight_decay * p(v.c));
    upd(v.c) = Tuple(p1, m1, v1);
    return upd;
  }

  Halide::Type t;
  bool bf16;  // activations stored as bf16
  Vars v;
};

}  // namespace remat::gen
