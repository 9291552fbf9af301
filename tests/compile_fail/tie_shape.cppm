// Must not compile: the head ties its weight [64, 500] to a token table of 512 tokens.
export module compile_fail_tie_shape;
import remat;
inline constexpr remat::Model bad = remat::checked([] {
  return remat::make_model(remat::tokens(512, 16), remat::name("wte", remat::embedding(512, 64)),
                           remat::repeat(2, remat::residual(remat::layer_norm(), remat::linear(64, 64))),
                           remat::layer_norm(), remat::linear(64, 500, remat::no_bias, remat::tied_to("wte")),
                           remat::softmax_cross_entropy());
});
