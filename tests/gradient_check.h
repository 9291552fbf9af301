// Shared by the layer gradient tests: float64 fixtures, central finite differences and
// comparisons with a plain C++ reference, all through compare() (compare.h): an element outside
// its tolerance, or NaN on either side, is a mismatch. Each call states its Tolerance and the
// worst error it observed (REMAT_SHOW_ERRORS=1 prints every comparison's figures).
#pragma once

#include <boost/test/unit_test.hpp>

#include <Halide.h>
#include <layers.h>

#include "compare.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace remat::testing {

using namespace Halide;

constexpr double fd_step = 1e-6;
constexpr Tolerance exact{0, 0};  // bit for bit (NaN still fails)

// A Func reading a buffer (Halide's Func(Buffer &) takes no name).
inline Func wrap(Buffer<double> b, const std::string &name) {
  Func f(name);
  f(_) = b(_);
  return f;
}

// got(pos) against ref(pos) at every element of got; reports, asserts nothing (see expect).
inline Comparison compare_ref(const Buffer<double> &got, const std::function<double(const int *)> &ref, Tolerance tol) {
  std::vector<double> g, r;
  got.for_each_element([&](const int *pos) {
    g.push_back(got(pos));
    r.push_back(ref(pos));
  });
  return compare(g, r, tol);
}
// grad against central differences of J with respect to every element of `in` (the reference).
inline Comparison compare_fd(Buffer<double> in, const Buffer<double> &grad, const std::function<double()> &J,
                             Tolerance tol) {
  std::vector<double> g, fd;
  in.for_each_element([&](const int *pos) {
    const double keep = in(pos);
    in(pos) = keep + fd_step;
    const double up = J();
    in(pos) = keep - fd_step;
    const double down = J();
    in(pos) = keep;
    fd.push_back((up - down) / (2 * fd_step));
    g.push_back(grad(pos));
  });
  return compare(g, fd, tol);
}
inline void expect(const std::string &what, const Comparison &c) {
  if (show_errors()) std::printf("[errors] %s: %s\n", what.c_str(), c.describe().c_str());
  BOOST_TEST(c.ok(), what << ": " << c.describe());
}
inline void check_ref(const std::string &what, const Buffer<double> &got, const std::function<double(const int *)> &ref,
                      Tolerance tol) {
  expect(what, compare_ref(got, ref, tol));
}
inline void check_fd(const std::string &what, Buffer<double> in, const Buffer<double> &grad,
                     const std::function<double()> &J, Tolerance tol) {
  expect(what, compare_fd(in, grad, J, tol));
}

struct Fixture {
  remat::gen::Vars v;
  remat::gen::Layers L{Float(64), v};
  std::mt19937_64 rng{1234};
  double uniform(double lo = -1, double hi = 1) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
  Buffer<double> random(std::vector<int> shape, double lo = -1, double hi = 1) {
    Buffer<double> b(shape);
    b.for_each_value([&](double &x) { x = uniform(lo, hi); });
    return b;
  }
  ImageParam param(const Buffer<double> &b, const std::string &name) {
    ImageParam p(Float(64), b.dimensions(), name);
    p.set(b);
    return p;
  }
  static std::vector<int> shape(const Buffer<double> &b) {
    std::vector<int> s;
    for (int d = 0; d < b.dimensions(); ++d) s.push_back(b.dim(d).extent());
    return s;
  }
  // J = sum(f * R) over R's shape. f by reference: a Func JIT-compiles its pipeline once and
  // keeps it, a copy made before the first realize would compile again on every call.
  static double objective(Func &f, const Buffer<double> &R) {
    Buffer<double> y = f.realize(shape(R));
    double j = 0;
    R.for_each_element([&](const int *pos) { j += y(pos) * R(pos); });
    return j;
  }
};

}  // namespace remat::testing
