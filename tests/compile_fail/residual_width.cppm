// Must not compile: a residual block may not change the width it adds back to.
export module compile_fail_residual_width;
import remat;
inline constexpr remat::Model bad = remat::checked([] {
  return remat::make_model(remat::input(10), remat::linear(10, 64),
                           remat::repeat(2, remat::residual(remat::linear(64, 32), remat::gelu())),
                           remat::softmax_cross_entropy());
});
