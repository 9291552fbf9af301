// Must not compile: the head ties its weight to a layer no one is named.
export module compile_fail_tie_unknown;
import remat;
inline constexpr remat::Model bad = remat::checked([] {
  return remat::make_model(remat::tokens(512, 16), remat::name("wte", remat::embedding(512, 64)),
                           remat::repeat(2, remat::residual(remat::layer_norm(), remat::linear(64, 64))),
                           remat::layer_norm(), remat::linear(64, 512, remat::no_bias, remat::tied_to("embed")),
                           remat::softmax_cross_entropy());
});
