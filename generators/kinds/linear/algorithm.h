// The linear kind's algorithm: y = x w + bias (w [K, O] row-major: w(o, k)) and its
// vector-Jacobian rules, as GEMMs (Layers::matmul). The model compiler runs them in Halide (the
// CPU's bf16 kernels, with fused epilogues) or hands them to a GEMM library (rules.h).
#pragma once

#include <Halide.h>

#include "layers.h"

#include <string>

namespace remat::gen {

inline MatMul linear(const Layers &L, const std::string &name, Halide::Func x, Halide::Func w, Halide::Func bias,
                     int in) {
  return L.matmul(name, x, w, in, [&](Halide::Expr sum) { return sum + bias(L.v.c); });
}
// dW(o, k) = sum_b x(k, b) dy(o, b); rows of the product are input features k.
inline MatMul linear_weight_grad(const Layers &L, const std::string &name, Halide::Func x, Halide::Func dy,
                                 Halide::Expr batch, const Layers::Epilogue &epilogue = {}) {
  Halide::Func xt(part(name, "xt"));
  xt(L.v.c, L.v.b) = x(L.v.b, L.v.c);  // xt(b, k) = x(k, b): the operand's row index is k
  return L.matmul(name, xt, dy, batch, epilogue);
}
// dx(k, b) = sum_o dy(o, b) wt(k, o)
inline MatMul linear_input_grad(const Layers &L, const std::string &name, Halide::Func dy, Halide::Func wt, int out) {
  return L.matmul(name, dy, wt, out);
}

}  // namespace remat::gen
