// What every layer kind's Halide algorithm (generators/kinds/<kind>/algorithm.h) is written with,
// and the algorithms that are not layers (the loss, AdamW): forward Funcs and hand-written
// vector-Jacobian rules. Element type is a parameter: float32 for the generated kernels, float64
// in the gradient tests.
// Activations may be stored as bf16: a layer's output is then rounded where it is defined
// (`store`) and readers widen it back; gradient terms stay in the element type until the model
// compiler sums and stores them.
//
// Layout: a [B, C] activation is a Func f(c, b) with c the contiguous feature index and b the
// row. A linear weight is w(o, k) ([K, O] row-major, y = x w + b).
#pragma once

#include <Halide.h>

#include <string>
#include <string_view>

namespace remat::gen {

// The name of a Func that is part of another (its accumulator, its reduction domain, a partial
// sum): <base>_<what>. Halide's names are for display only (lowered statements, messages).
inline std::string part(const std::string &base, std::string_view what) { return base + '_' + std::string(what); }

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

class Layers {
public:
  Layers(Halide::Type type, const Vars &v, bool bf16 = false) : t(type), bf16(bf16), v(v) {}

  Halide::Expr constant(double x) const { return Halide::Internal::make_const(t, x); }
  // A stored activation: itself, or its bf16 bits.
  Halide::Expr store(Halide::Expr e) const { return bf16 ? to_bf16_bits(e) : e; }

  // column sum over rows: db(o) = sum_b dy(o, b)
  Halide::Func column_sum(const std::string &name, Halide::Func f, Halide::Expr batch) const {
    Halide::Func s(name);
    Halide::RDom r(0, batch, part(name, "r"));
    s(v.c) = constant(0);
    s(v.c) += f(v.c, r);
    return s;
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
