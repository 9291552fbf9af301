// The rope kind's float64 reference for the tests (tests/kind_reference.h): the rotate-half rotation of each q and k
// head by t theta^(-2i/D) (llama3-scaled where set); v passes.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::rope> {
  // theta^(-2i / D), scaled by the llama3 rule (as Transformers' _compute_llama3_parameters) if set
  static double inverse_frequency(const Layer &l, int i, int D) {
    const double f = std::pow(l.rope_theta, -2.0 * i / D);
    const Layer::RopeScaling &s = l.rope_scaling;
    if (!s.enabled()) return f;
    const double wavelength = 2 * M_PI / f;
    if (wavelength < s.original_context / s.high_freq_factor) return f;
    if (wavelength > s.original_context / s.low_freq_factor) return f / s.factor;
    const double smooth =
        (s.original_context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    return (1 - smooth) * f / s.factor + smooth * f;
  }
  static Rows rotate(LayerSite &r, const Layer &l, const Rows &x, double direction) {
    const int W = l.out, D = W / (l.heads + 2 * l.kv_heads), half = D / 2, rotated = (l.heads + l.kv_heads) * D;
    Rows y = x;
    for (long b = 0; b < r.rows; ++b)
      for (int c = 0; c < rotated; c += D)
        for (int i = 0; i < half; ++i) {
          const double angle = direction * double(b % l.block_size) * inverse_frequency(l, i, D);
          const double lo = x[b * W + c + i], hi = x[b * W + c + i + half];
          y[b * W + c + i] = lo * std::cos(angle) - hi * std::sin(angle);
          y[b * W + c + i + half] = hi * std::cos(angle) + lo * std::sin(angle);
        }
    return y;
  }
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &) { return rotate(r, l, x, 1); }
  static Rows backward(LayerSite &r, const Layer &l, const Saved &, const Rows &dy) { return rotate(r, l, dy, -1); }
};

}  // namespace remat::testing
