// Must not compile: the second linear of the block expects 512 features, the first makes 256.
export module compile_fail_shape_mismatch;
import remat;
inline constexpr remat::Model bad = remat::checked([] {
  return remat::make_model(remat::input(784), remat::linear(784, 256),
                           remat::repeat(4, remat::residual(remat::layer_norm(), remat::linear(512, 256))),
                           remat::softmax_cross_entropy());
});
