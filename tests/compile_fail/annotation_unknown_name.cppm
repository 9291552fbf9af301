// Must not compile: the stage's policy saves a tensor no layer of the block is named.
export module compile_fail_annotation_unknown_name;
import remat;
inline constexpr remat::Model model = remat::checked([] {
  return remat::make_model(
      remat::input(8),
      remat::repeat(2, remat::residual(remat::linear(8, 8), remat::name("act", remat::gelu()), remat::linear(8, 8)),
                    remat::save_only_these_names("activation")),
      remat::softmax_cross_entropy());
});
