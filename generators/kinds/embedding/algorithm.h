// The embedding kind's algorithm: token + position embedding of token ids, and its
// vector-Jacobian rule (scatter-adds into the tables; no input gradient).
#pragma once

#include <Halide.h>

#include "layers.h"
#include "sequences.h"

#include <optional>
#include <string>

namespace remat::gen {

class Embedding {
public:
  struct Grad {
    Halide::Func dwte, dwpe;
  };

  explicit Embedding(const Sequences &sequences) : L(sequences.L), v(sequences.v), T(sequences.T) {}

  // x(c, b) = wte(c, tokens(b)) + wpe(c, b % T); wte [V, C] is wte(c, token), wpe [T, C] (none:
  // token embedding only). Tokens outside [0, V) are clamped (the data loader guarantees they are not).
  Halide::Func forward(const std::string &name, Halide::Func tokens, Halide::Func wte, std::optional<Halide::Func> wpe,
                       int V) const {
    Halide::Func x(name);
    Halide::Expr token = wte(v.c, Halide::clamp(tokens(v.b), 0, V - 1));
    x(v.c, v.b) = L.store(wpe ? token + (*wpe)(v.c, v.b % T) : token);
    return x;
  }
  // dwte(c, token) = sum over rows b with tokens(b) == token of dx(c, b) (scatter-add over rows);
  // dwpe(c, t) = sum_n dx(c, n T + t). rows must be a multiple of T.
  // dwte and dwpe start from `initial_wte` / `initial_wpe` (zero by default; the model compiler
  // passes the previous gradient when it accumulates) and are the Funcs' own names.
  Grad grad(const std::string &name, Halide::Func tokens, Halide::Func dx, int V, Halide::Expr rows,
            std::optional<Halide::Expr> initial_wte = {}, std::optional<Halide::Expr> initial_wpe = {},
            const std::string &wte_name = {}, const std::string &wpe_name = {}) const {
    using namespace Halide;
    Grad g{Func(wte_name.empty() ? part(name, "dwte") : wte_name),
           Func(wpe_name.empty() ? part(name, "dwpe") : wpe_name)};
    RDom r(0, rows, part(name, "r"));
    g.dwte(v.c, v.b) = initial_wte.value_or(L.constant(0));
    g.dwte(v.c, clamp(tokens(r), 0, V - 1)) += dx(v.c, r);  // scatter-add of the rows
    RDom rn(0, rows / T, part(name, "n"));
    g.dwpe(v.c, v.b) = initial_wpe.value_or(L.constant(0));
    g.dwpe(v.c, v.b) += dx(v.c, rn * T + v.b);
    return g;
  }

  const Layers &L;
  Vars v;
  int T;
};

}  // namespace remat::gen
