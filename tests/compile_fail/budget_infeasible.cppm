// Must not compile: a 4 KiB budget cannot hold this model's plan; the error states the least
// feasible bytes.
export module compile_fail_budget_infeasible;
import remat;
inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(remat::input(8), remat::linear(8, 16),
                           remat::repeat(4, remat::residual(remat::layer_norm(), remat::linear(16, 16))),
                           remat::linear(16, 3), remat::softmax_cross_entropy());
});
static_assert(remat::feasible<model, remat::budget(4 * remat::KiB), 8>());
