// Element-wise comparison that fails on non-finite values: an element matches only when
// |got - ref| <= atol + rtol * |ref| holds, which is false for a NaN or an infinity on either
// side. atol is given relative to the tensor's scale (its largest reference magnitude), since the
// rounding error of a value is set by the size of the terms summed into it, not by the value:
// a near-zero gradient entry that results from cancellation carries the error of its terms.
// Each test states its Tolerance and the worst error it observed (`worst` below, printed with
// REMAT_SHOW_ERRORS=1).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <limits>
#include <span>
#include <sstream>
#include <string>

namespace remat::testing {

struct Tolerance {
  double atol;  // times the tensor's largest reference magnitude
  double rtol;  // times the element's reference magnitude
};

struct Comparison {
  std::size_t elements = 0, mismatches = 0;
  std::size_t first_mismatch = std::numeric_limits<std::size_t>::max();
  double scale = 0;           // largest |ref| (NaN if ref holds a non-finite value)
  double worst = 0;           // largest |got - ref| / (atol + rtol |ref|) over matching elements
  double worst_of_scale = 0;  // largest |got - ref| / scale over matching elements
  double got_at_first = 0, ref_at_first = 0;
  bool ok() const { return mismatches == 0 && elements > 0; }
  std::string describe() const {
    std::ostringstream s;
    s << mismatches << " of " << elements << " elements outside the tolerance";
    if (mismatches)
      s << " (first at " << first_mismatch << ": got " << got_at_first << ", reference " << ref_at_first << ")";
    s << "; worst matching error " << worst_of_scale << " of scale " << scale << " (" << worst << " of the limit)";
    return s.str();
  }
};

template <class G, class R>
Comparison compare(std::span<const G> got, std::span<const R> ref, Tolerance tol) {
  Comparison c;
  c.elements = std::min(got.size(), ref.size());
  if (got.size() != ref.size()) c.mismatches = std::max(got.size(), ref.size()) - c.elements;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double r = double(ref[i]);
    c.scale = std::isfinite(r) ? std::max(c.scale, std::abs(r)) : std::numeric_limits<double>::quiet_NaN();
  }
  for (std::size_t i = 0; i < c.elements; ++i) {
    const double g = double(got[i]), r = double(ref[i]);
    const double error = std::abs(g - r), limit = tol.atol * c.scale + tol.rtol * std::abs(r);
    if (!(error <= limit)) {  // NaN anywhere (got, ref or scale) lands here
      if (c.first_mismatch > i) {
        c.first_mismatch = i;
        c.got_at_first = g;
        c.ref_at_first = r;
      }
      ++c.mismatches;
      continue;
    }
    if (limit > 0) c.worst = std::max(c.worst, error / limit);
    if (c.scale > 0) c.worst_of_scale = std::max(c.worst_of_scale, error / c.scale);
  }
  return c;
}

template <class G, class R>
Comparison compare(const G &got, const R &ref, Tolerance tol) {
  return compare(std::span<const typename G::value_type>(got), std::span<const typename R::value_type>(ref), tol);
}

inline bool show_errors() { return std::getenv("REMAT_SHOW_ERRORS") != nullptr; }

// A baseline that bit-identity tests compare against must be a real result: all finite and not
// all zero (two runs that both left NaN, or zeros, would compare equal).
// A running worst error that a non-finite error poisons: std::max(worst, NaN) returns worst (every
// comparison with NaN is false), so a NaN written by a kernel would vanish from the maximum; here
// it stays NaN (and an infinity stays infinite), and a check `worse(...) <= limit` fails.
inline double worse(double worst, double error) {
  return std::isnan(worst) || std::isnan(error) ? std::numeric_limits<double>::quiet_NaN() : std::max(worst, error);
}

template <class T>
bool finite_and_nonzero(std::span<const T> values) {
  bool nonzero = false;
  for (T v : values) {
    if (!std::isfinite(double(v))) return false;
    nonzero = nonzero || v != T(0);
  }
  return nonzero;
}
template <class V>
bool finite_and_nonzero(const V &values) {
  return finite_and_nonzero(std::span<const typename V::value_type>(values));
}

}  // namespace remat::testing
