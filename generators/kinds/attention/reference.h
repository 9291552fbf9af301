// The attention kind's float64 reference for the tests (tests/kind_reference.h): P = softmax of scaled causal scores;
// out = drop(P) v.
#pragma once

#include "kind_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace remat::testing {

template <>
struct KindReference<Op::attention> {
  // Columns of a qkv row [q (H heads) | k (KV heads) | v (KV heads)] of layer l: query head h's
  // feature e, and the feature e of the key and value head that query head h reads.
  static int q_col(const Layer &l, int h, int e) { return h * (l.out / l.heads) + e; }
  static int k_col(const Layer &l, int h, int e) { return l.out + h / (l.heads / l.kv_heads) * (l.out / l.heads) + e; }
  static int v_col(const Layer &l, int h, int e) { return k_col(l, h, e) + l.kv_heads * (l.out / l.heads); }
  // Causal softmax of row b's scaled scores for head h over positions 0..t (x is [R, l.in] qkv).
  static std::vector<double> softmax_row(const Rows &x, long b, int h, const Layer &l) {
    const int W = l.in, D = l.out / l.heads, T = l.block_size;
    const long n = b / T, t = b % T;
    std::vector<double> p(t + 1);
    double mx = -INFINITY, z = 0;
    for (long j = 0; j <= t; ++j) {
      double d = 0;
      for (int e = 0; e < D; ++e) d += x[b * W + q_col(l, h, e)] * x[(n * T + j) * W + k_col(l, h, e)];
      p[j] = d / std::sqrt(double(D));
      mx = std::max(mx, p[j]);
    }
    for (long j = 0; j <= t; ++j) z += std::exp(p[j] - mx);
    for (long j = 0; j <= t; ++j) p[j] = std::exp(p[j] - mx) / z;
    return p;
  }
  static Rows forward(LayerSite &r, const Layer &l, const Rows &x, Saved &s) {
    const long R = r.rows;
    const int C = l.out, H = l.heads, D = C / H, T = l.block_size;
    Rows y(std::size_t(R) * C);
    s.prob.assign(std::size_t(R) * H * T, 0.0);
    for (long b = 0; b < R; ++b)
      for (int h = 0; h < H; ++h) {
        const long n = b / T, t = b % T;
        const std::vector<double> p = softmax_row(x, b, h, l);
        for (long j = 0; j <= t; ++j) {
          const std::uint64_t element = ((std::uint64_t(n) * H + h) * T + t) * T + j;
          s.prob[(b * H + h) * T + j] = p[j] * r.keep(element);
        }
        for (int e = 0; e < D; ++e) {
          double acc = 0;
          for (long j = 0; j <= t; ++j) acc += s.prob[(b * H + h) * T + j] * x[(n * T + j) * l.in + v_col(l, h, e)];
          y[b * C + h * D + e] = acc;
        }
      }
    return y;
  }
  // the textbook softmax Jacobian on the undropped probabilities
  static Rows backward(LayerSite &r, const Layer &l, const Saved &s, const Rows &dy) {
    const long R = r.rows;
    const int C = l.out, H = l.heads, D = C / H, T = l.block_size;
    const Rows &x = s.in;
    const int W = l.in;
    auto q_col = [&](int h, int e) { return KindReference::q_col(l, h, e); };
    auto k_col = [&](int h, int e) { return KindReference::k_col(l, h, e); };
    auto v_col = [&](int h, int e) { return KindReference::v_col(l, h, e); };
    Rows dx(std::size_t(R) * W, 0.0);
    for (long b = 0; b < R; ++b)
      for (int h = 0; h < H; ++h) {
        const long n = b / T, t = b % T;
        std::vector<double> p, kp(t + 1), dp(t + 1);
        double dot = 0;
        for (long j = 0; j <= t; ++j) {
          const std::uint64_t element = ((std::uint64_t(n) * H + h) * T + t) * T + j;
          const double k = r.keep(element);
          kp[j] = s.prob[(b * H + h) * T + j];
          double g = 0;
          for (int e = 0; e < D; ++e) g += dy[b * C + h * D + e] * x[(n * T + j) * W + v_col(h, e)];
          dp[j] = g * k;
          for (int e = 0; e < D; ++e) dx[(n * T + j) * W + v_col(h, e)] += kp[j] * dy[b * C + h * D + e];
        }
        p = softmax_row(x, b, h, l);  // the undropped probabilities
        for (long j = 0; j <= t; ++j) dot += p[j] * dp[j];
        for (long j = 0; j <= t; ++j) {
          const double ds = p[j] * (dp[j] - dot) / std::sqrt(double(D));
          for (int e = 0; e < D; ++e) {
            dx[b * W + q_col(h, e)] += ds * x[(n * T + j) * W + k_col(h, e)];
            dx[(n * T + j) * W + k_col(h, e)] += ds * x[b * W + q_col(h, e)];
          }
        }
      }
    return dx;
  }
};

}  // namespace remat::testing
