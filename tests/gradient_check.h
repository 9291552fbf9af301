// Shared by the layer gradient tests: float64 fixtures, central finite differences and
// comparisons with a plain C++ reference. Each test file states why its tolerances hold.
#pragma once

#include <boost/test/unit_test.hpp>

#include <Halide.h>
#include <layers.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace remat::testing {

using namespace Halide;

constexpr double fd_step = 1e-6, fd_tol = 1e-7, ref_tol = 1e-11;

// A Func reading a buffer (Halide's Func(Buffer &) takes no name).
Func wrap(Buffer<double> b, const std::string &name) {
  Func f(name);
  f(_) = b(_);
  return f;
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
  // J = sum(f * R) over R's shape
  static double objective(Func f, const Buffer<double> &R) {
    Buffer<double> y = f.realize(shape(R));
    double j = 0;
    R.for_each_element([&](const int *pos) { j += y(pos) * R(pos); });
    return j;
  }
  // Central differences of J with respect to every element of `in`, compared with `grad`.
  static void check_fd(const std::string &what, Buffer<double> in, const Buffer<double> &grad,
                       const std::function<double()> &J) {
    in.for_each_element([&](const int *pos) {
      const double keep = in(pos);
      in(pos) = keep + fd_step;
      const double up = J();
      in(pos) = keep - fd_step;
      const double down = J();
      in(pos) = keep;
      const double fd = (up - down) / (2 * fd_step), g = grad(pos);
      BOOST_TEST(std::abs(fd - g) <= fd_tol * (1 + std::abs(g)),
                 what << " at (" << pos[0] << ", " << pos[1] << "): fd " << fd << " vs vjp " << g);
    });
  }
  static void check_ref(const std::string &what, const Buffer<double> &got, const std::function<double(const int *)> &ref) {
    got.for_each_element([&](const int *pos) {
      const double r = ref(pos), g = got(pos);
      BOOST_TEST(std::abs(r - g) <= ref_tol * (1 + std::abs(g)),
                 what << " at (" << pos[0] << ", " << pos[1] << "): reference " << r << " vs vjp " << g);
    });
  }
};

}  // namespace remat::testing
