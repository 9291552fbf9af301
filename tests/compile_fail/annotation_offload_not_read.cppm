// Must not compile: the stage's policy offloads the output of a linear that only feeds the
// residual sum, which no backward reads: there is nothing to bring back.
export module compile_fail_annotation_offload_not_read;
import remat;
inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(
      remat::input(8),
      remat::repeat(2,
                    remat::residual(remat::name("norm", remat::layer_norm()), remat::name("proj", remat::linear(8, 8))),
                    remat::save_and_offload_only_these_names({"norm"}, {"proj"})),
      remat::softmax_cross_entropy());
});
