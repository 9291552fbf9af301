// Must not compile: the stage's policy saves the output of a linear that only feeds the residual
// sum, which no backward reads.
export module compile_fail_annotation_not_read;
import remat;
inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(
      remat::input(8),
      remat::repeat(2, remat::residual(remat::layer_norm(), remat::name("proj", remat::linear(8, 8))),
                    remat::save_only_these_names("proj")),
      remat::softmax_cross_entropy());
});
