// What a layer kind's float64 reference is written against (generators/kinds/<kind>/reference.h:
// a specialization KindReference<Op::<kind>>, listed in generators/kinds/list.h): the model-level
// references of the tests (test_model_gradients.cpp) run every layer of a model through its kind's
// forward and backward here, in float64, and compare the kernels' row losses and gradients.
#pragma once

#include <cstdint>
#include <vector>
import remat.language;

namespace remat::testing {

using Rows = std::vector<double>;  // [R, width] row-major

// What one layer of the run gives its kind's reference: the rows, its parameters and gradients by
// their index in the kind's traits (Kind::params: 0 the weight or gain, 1 the bias), the dropout
// factor of an element at its site (0 or 1 / (1 - p), from the counters as the kernels'), and the
// token ids of the batch.
class LayerSite {
public:
  virtual ~LayerSite() = default;
  long rows = 0;
  virtual std::vector<double> param(int index) const = 0;
  virtual void put_grad(int index, Rows gradient) = 0;
  virtual double keep(std::uint64_t element) const = 0;
  virtual std::vector<std::int32_t> tokens() const = 0;
};

// What a layer's forward keeps for its backward.
struct Saved {
  Rows in, out;
  std::vector<double> mean, rstd, prob;
  std::vector<std::int32_t> tokens;
};

// A kind's reference: static Rows forward(LayerSite &, const Layer &, const Rows &x, Saved &)
// (its output; what its backward needs into Saved, s.in and s.out are filled by the caller) and
// static Rows backward(LayerSite &, const Layer &, const Saved &, const Rows &dy) (its input's
// gradient; its parameters' gradients through put_grad). Kinds without one are wiring (the
// residual markers: a model's reference adds the skip itself).
template <Op op>
struct KindReference {};

// A kind's reference as the tests call it (nullptr: none).
struct ReferenceEntry {
  Rows (*forward)(LayerSite &, const Layer &, const Rows &, Saved &) = nullptr;
  Rows (*backward)(LayerSite &, const Layer &, const Saved &, const Rows &) = nullptr;
};
template <Op op>
ReferenceEntry reference_entry() {
  if constexpr (requires { KindReference<op>::forward; })
    return {&KindReference<op>::forward, &KindReference<op>::backward};
  else
    return {};
}

}  // namespace remat::testing
