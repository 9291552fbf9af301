// The rope kind's algorithm: rotary position embedding (the rotate-half form of Llama and
// GPT-NeoX, base 10000 unless given, llama3-scaled where asked) of the q and k heads of a fused [q | k | v] row, and
// its inverse.
//
// On x(c, b) = [q (q_heads D) | k (kv_heads D) | v]: in each q and k head, feature e < D / 2 and
// its partner e + D / 2 turn by the angle t theta^(-2e / D) (t = b % T, theta = 10000):
//   y(e) = x(e) cos - x(e + D/2) sin,  y(e + D/2) = x(e + D/2) cos + x(e) sin;  v unchanged.
// inverse: the transposed rotation (the vector-Jacobian rule). Not rounded (L.store is the
// caller's).
#pragma once

#include <Halide.h>

#include "layers.h"
#include "sequences.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace remat::gen {

// rope_type "llama3" (remat::rope_llama3); factor 0: none
struct RopeLlama3 {
  double factor = 0, low_freq_factor = 0, high_freq_factor = 0, original_context = 0;
};

class Rope {
public:
  // cos and sin of the angle of feature e < D / 2 at the position of row b: (e, b), b over the
  // rows of every sequence (position b % T), computed for the rows a consumer's task covers.
  struct Table {
    Halide::Func cos, sin;
  };

  using Llama3 = RopeLlama3;
  static constexpr double default_theta = 10000;  // the checks'
  // theta: the layer's base (remat::rope(..., rope_theta(t))).
  explicit Rope(const Sequences &sequences, double theta = default_theta, Llama3 scaling = {})
      : L(sequences.L), v(sequences.v), T(sequences.T), theta(theta), scaling(scaling) {}

  Table table(const std::string &name, int D) const {
    using namespace Halide;
    Table tab{Func(part(name, "cos")), Func(part(name, "sin"))};
    const Expr angle = rope_angle(v.c, v.b % T, D);
    tab.cos(v.c, v.b) = cos(angle);
    tab.sin(v.c, v.b) = sin(angle);
    return tab;
  }
  // The rotation; with a table, its cos and sin are read from it (the same values: the table
  // evaluates the same expressions), not computed per element.
  Halide::Func rotate(const std::string &name, Halide::Func x, int q_heads, int kv_heads, int D, bool inverse = false,
                      const Table *table = nullptr) const {
    using namespace Halide;
    if (D % 2 != 0) throw std::invalid_argument("remat: rope needs an even head width");
    const int rotated = (q_heads + kv_heads) * D, half = D / 2;
    const Expr e = v.c % D, low = e < half;
    const Expr i = e % half, position = v.b % T, angle = rope_angle(i, position, D);
    const Expr cos_t = table ? table->cos(i, v.b) : cos(angle), sin_t = table ? table->sin(i, v.b) : sin(angle);
    const Expr partner = x(clamp(select(low, v.c + half, v.c - half), 0, rotated - 1), v.b);
    const Expr sin_term = select(low != inverse, -partner, partner) * sin_t;
    Func y(name);
    y(v.c, v.b) = select(v.c < rotated, x(v.c, v.b) * cos_t + sin_term, x(v.c, v.b));
    return y;
  }

  const Layers &L;
  Vars v;
  int T;
  double theta;
  Llama3 scaling;

private:
  // The angle of feature i < D / 2 at position t: t theta^(-2i / D), the inverse frequency
  // theta^(-2i / D) scaled as llama3's where asked.
  Halide::Expr rope_angle(Halide::Expr i, Halide::Expr t, int D) const {
    Halide::Expr inverse = Halide::exp(Halide::cast(L.t, i) * L.constant(-2.0 * std::log(theta) / D));
    if (scaling.factor > 0) inverse = llama3(inverse);
    return Halide::cast(L.t, t) * inverse;
  }
  // Transformers' llama3 rule: wavelengths 2 pi / f longer than original / low_freq_factor divided
  // by factor, shorter than original / high_freq_factor kept, blended between.
  Halide::Expr llama3(Halide::Expr f) const {
    const Llama3 &s = scaling;
    const Halide::Expr wavelength = L.constant(2 * M_PI) / f;
    const Halide::Expr smooth = (L.constant(s.original_context) / wavelength - L.constant(s.low_freq_factor)) /
                                L.constant(s.high_freq_factor - s.low_freq_factor);
    const Halide::Expr scaled = f / L.constant(s.factor);
    return Halide::select(wavelength<L.constant(s.original_context / s.high_freq_factor), f, wavelength> L.constant(
                              s.original_context / s.low_freq_factor),
                          scaled, (L.constant(1) - smooth) * scaled + smooth * f);
  }
};

}  // namespace remat::gen
