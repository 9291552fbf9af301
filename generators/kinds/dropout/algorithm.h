// The dropout kind's algorithm, and the counter-based RNG its masks (and attention's) come from:
// stateless, so a recompute reproduces a mask bit for bit without saving it.
#pragma once

#include <Halide.h>

#include "layers.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace remat::gen {

// ---- Counter-based RNG ---------------------------------------------------------------------
// splitmix64's output function (Stafford's "Mix13" finalizer): a bijection on 64-bit words with
// full avalanche. All arithmetic is UInt(64), multiplication wrapping mod 2^64.
inline Halide::Expr mix64(Halide::Expr x) {
  using namespace Halide;
  x = cast(UInt(64), x);
  x = x ^ (x >> 30);
  x = x * Expr(uint64_t{0xbf58476d1ce4e5b9ULL});
  x = x ^ (x >> 27);
  x = x * Expr(uint64_t{0x94d049bb133111ebULL});
  x = x ^ (x >> 31);
  return x;
}
inline constexpr uint64_t rng_golden = 0x9e3779b97f4a7c15ULL;  // splitmix64's increment

// Stateless 64-bit hash of the counters (seed, step, block, element), each widened to UInt(64):
//   key = mix64(mix64(mix64(seed + G) + (step + 1) G) + (block + 1) G)
//   out = mix64(key + (element + 1) G)          with G = rng_golden
// i.e. the three outer counters pick a splitmix64 stream and `element` indexes into it exactly
// as splitmix64 does (its n-th output is mix64(state0 + n G)). No state: evaluating it again,
// in another pipeline or on another device, gives identical bits.
inline Halide::Expr counter_hash(Halide::Expr seed, Halide::Expr step, Halide::Expr block, Halide::Expr element) {
  using namespace Halide;
  auto u = [](Expr e) { return cast(UInt(64), e); };
  const Expr G(rng_golden);
  Expr key = mix64(u(seed) + G);
  key = mix64(key + (u(step) + Expr(uint64_t{1})) * G);
  key = mix64(key + (u(block) + Expr(uint64_t{1})) * G);
  return mix64(key + (u(element) + Expr(uint64_t{1})) * G);
}
// Drop threshold on the hash's top 32 bits: an element is kept when (hash >> 32) >= threshold,
// so P(keep) = 1 - threshold / 2^32 = 1 - p up to 2^-33. p = 0 gives threshold 0: always kept.
inline uint64_t drop_threshold(double p) {
  if (!(p >= 0 && p < 1)) throw std::invalid_argument("remat: dropout probability must be in [0, 1)");
  return static_cast<uint64_t>(std::llround(p * 4294967296.0));
}
// Bool: whether the element is kept; threshold is a UInt(64) Expr (a run-time parameter or a
// constant from drop_threshold).
inline Halide::Expr keep_mask(Halide::Expr seed, Halide::Expr step, Halide::Expr block, Halide::Expr element,
                              Halide::Expr threshold) {
  using namespace Halide;
  return (counter_hash(seed, step, block, element) >> 32) >= cast(UInt(64), threshold);
}
inline Halide::Expr keep_mask(Halide::Expr seed, Halide::Expr step, Halide::Expr block, Halide::Expr element,
                              double p) {
  return keep_mask(seed, step, block, element, Halide::Expr(drop_threshold(p)));
}

// Dropout configuration. seed: per run; step: training step; block: which dropout site (layer
// index times a site count, say) so that sites never share a mask. The probability is either a
// constant (p == 0 then builds no mask and no scaling at all) or run-time parameters: the
// threshold of keep_mask and the scale 1 / (1 - p) (threshold 0 and scale 1 keep every element
// and multiply by exactly 1).
struct Dropout {
  Halide::Expr seed, step, block, threshold, scale;
  Halide::Expr first_row;  // added to a row before its element index (undefined: 0)
  bool enabled = false;
  Dropout() = default;
  Dropout(Halide::Expr seed, Halide::Expr step, Halide::Expr block, double p)
      : seed(seed),
        step(step),
        block(block),
        threshold(Halide::Expr(drop_threshold(p))),
        scale(Halide::Expr(p == 0 ? 1.0 : 1 / (1 - p))),
        enabled(p != 0) {}
  Dropout(Halide::Expr seed, Halide::Expr step, Halide::Expr block, Halide::Expr threshold, Halide::Expr scale,
          Halide::Expr first_row = {})
      : seed(seed), step(step), block(block), threshold(threshold), scale(scale), first_row(first_row), enabled(true) {}
  // Row b of the call as a row of the step's global batch (the masks' element counter).
  Halide::Expr row(Halide::Expr b) const { return first_row.defined() ? b + first_row : b; }
  Dropout at(Halide::Expr site) const {  // the same configuration for another site
    Dropout d = *this;
    d.block = site;
    return d;
  }
};

// ---- Dropout on a generic activation [rows, width] -------------------------------------------
// Element index = c + width * b.
inline Halide::Expr activation_element(Halide::Expr c, Halide::Expr b, int width) {
  using namespace Halide;
  return cast(UInt(64), c) + cast(UInt(64), b) * Expr(uint64_t(width));
}
// keep / (1 - p) for one element: 0 or 1 / (1 - p), in the element type.
inline Halide::Expr dropout_factor(const Layers &L, const Dropout &d, Halide::Expr element) {
  return Halide::select(keep_mask(d.seed, d.step, d.block, element, d.threshold), Halide::cast(L.t, d.scale),
                        L.constant(0));
}
// y = x * keep / (1 - p)
inline Halide::Func dropout(const Layers &L, const std::string &name, Halide::Func x, int width, const Dropout &d) {
  Halide::Func y(name);
  y(L.v.c, L.v.b) = d.enabled ? x(L.v.c, L.v.b) * dropout_factor(L, d, activation_element(L.v.c, d.row(L.v.b), width))
                              : Halide::Expr(x(L.v.c, L.v.b));
  return y;
}
// dx = dy * keep / (1 - p), the same mask recomputed from the counters
inline Halide::Func dropout_grad(const Layers &L, const std::string &name, Halide::Func dy, int width,
                                 const Dropout &d) {
  return dropout(L, name, dy, width, d);  // the rule is linear and self-adjoint
}

}  // namespace remat::gen
